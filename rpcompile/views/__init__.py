"""Views: plans, profiles and timelines drawn for people. Tables and number formats (:mod:`.report`, over
:mod:`.terminal`'s tables that show text as written), timelines (:mod:`.gantt`), the plan drawn over the model
(:mod:`.graphview`, rolled up into module boxes by :mod:`.graph_rollup`) and the SVG they share (:mod:`.svg`).
Views read what the planner, training and the runtime produce; nothing below them imports a view.
"""

"""Saved segments: a segment's backward run from activations kept in host memory instead of recomputing it. When
to capture and how a saved segment runs (:mod:`.saved`), the AOTAutograd capture (:mod:`.capture`), symbolic sizes
so that one capture serves every batch size and sequence length (:mod:`.symbolic`), and which segments share a
capture (:mod:`.sharing`).
"""

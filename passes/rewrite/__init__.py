"""Rewrite: passes that change a traced graph, and the cut into stage code. The loss inside the graph and the LM
head split along the sequence (:mod:`.loss_head`), token embeddings run on the host (:mod:`.host`), nodes grouped
into segments the partitioner can afford (:mod:`.coarsen`), a plan split into stage programs (:mod:`.split`) and
stage code written out for people (:mod:`.codegen`). It imports the graph and cost rooms, core and torch.
"""

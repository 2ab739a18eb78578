"""Checkpoints in the ecosystem's formats: exact save and resume, weights any tool opens, saves in the background.

training state
    Three ``state_dict``\\ s: the model's (fp32 masters, buffers), the optimizer's, and the **pipeline's**
    (:meth:`Pipeline.state_dict <rpcompile.training.pipeline.Pipeline.state_dict>`: iteration, dropout seed,
    scaler, an overlapped step's weights; :mod:`.state`). Not saved: gradients, weight copies and captures
    (remade from the masters), the user's random state and the data position (pass them in ``extra=``).
checkpoint
    A directory (:mod:`.layout`) other tools open without rpcompile: the weights as safetensors laid out as HF
    ``save_pretrained`` lays them out (:mod:`~rpcompile.training.checkpoint.weights`, :mod:`.tensorfile`), each
    optimizer's ``state_dict()`` as ``torch.save``, the pipeline's state (:mod:`.pipeline_file`), ``extra``, and a
    checksummed manifest; written whole or not at all and checked whole before anything loads. The plan goes
    beside the checkpoints once (:func:`~rpcompile.checkpoint_plan`); ``background=True`` saves on a thread
    (:mod:`~rpcompile.training.checkpoint.background`); the earlier single-file format still loads (:mod:`.legacy`).

Each name has one home: :mod:`.save` (``save_checkpoint``, ``save_weights``, ``convert``), :mod:`.load`
(``load_checkpoint``, ``checkpoint_plan``, ``load_weights``), :mod:`.state` (``Checkpoint``, ``CheckpointError``,
the pipeline's state), :mod:`~rpcompile.training.checkpoint.background` (``PendingSave``), :mod:`.layout`
(``checkpoints``, ``verify_path``); the public ones are also ``rpcompile.<name>``.
"""

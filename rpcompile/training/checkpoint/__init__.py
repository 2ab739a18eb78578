"""Checkpoints in the ecosystem's formats: exact save and resume, weights any tool opens, saves in the background.

Three ``state_dict``\\ s make a training run: the model's (fp32 masters, buffers such as BatchNorm statistics;
frozen parameters in the compute precision unless ``frozen_masters=True``), the optimizer's (moments, step
counts, learning rates) and the **pipeline's** (:meth:`Pipeline.state_dict
<rpcompile.training.pipeline.Pipeline.state_dict>`: the iteration and dropout seed that seed every mask, the
GradScaler's state, the weights an overlapped step left for the next iteration, and what they were computed with,
:mod:`.state`). Not saved, by design: gradients (checkpoint after the optimizer step), the weight copies and
saved-segment captures (remade from the masters), the user's random state and the data loader's position (pass
what you need in ``extra=``, e.g. the batches consumed and an lr scheduler's ``state_dict``).

**A checkpoint is a directory** (:mod:`.layout`) that other tools open without rpcompile:

- the weights as **safetensors**, laid out as HF ``save_pretrained`` lays them out (``model.safetensors``, or
  shards and ``model.safetensors.index.json``; tied weights once; an HF model's ``config.json``): read by
  ``safetensors.torch.load_file``, ``AutoModelForCausalLM.from_pretrained(directory)`` and, into any model with
  no pipeline, :func:`~rpcompile.load_weights` (:mod:`~rpcompile.training.checkpoint.weights`, :mod:`.tensorfile`);
- each **optimizer's state** as a plain ``optimizer.state_dict()`` saved with ``torch.save`` (``optimizer.pt``),
  which ``optimizer.load_state_dict(torch.load(path, weights_only=True))`` restores anywhere. Chosen over
  ``torch.distributed.checkpoint`` because that format's ``.metadata`` is read with a full ``pickle.load`` (files
  would be code), it needs its own API to read, and its resharding across ranks buys nothing here: the
  optimizer's state lives whole in each process's host memory;
- the **pipeline's state** as ``pipeline.json`` (readable: the iteration, the dropout seed, the scaler, the plan)
  with its tensors, if any, in ``pipeline.safetensors`` (:mod:`.pipeline_file`); ``extra`` as ``extra.pt``;
- ``checkpoint.json``, the manifest: every file's size and sha256, written last.

It is written whole or not at all (a temporary directory beside it, every file ``fsync``'d, renamed into place:
:func:`rpcompile.core.files.atomic_directory`), checked whole before anything loads (sizes and checksums, then
every header and field parsed as bounded data: nothing is unpickled beyond ``torch.load(weights_only=True)``), and
a torn or corrupt one is moved aside with a one-line warning while the previous one is used. The plan goes beside
the checkpoints once, as ``plan.json`` (:func:`~rpcompile.checkpoint_plan`: compile the resumed run with it, since a fresh
plan may cut otherwise). ``save_checkpoint(..., background=True)`` writes on a thread while training goes on
(:mod:`~rpcompile.training.checkpoint.background`: a copy of the weights and optimizer state, which steps wait for, then the write). The earlier
single-file format (``ckpt-<step>.ckpt``) still loads; ``rpcompile checkpoint convert OLD NEW`` rewrites it
(:mod:`.legacy`).

Each name has one home: :mod:`.save` (``save_checkpoint``, ``save_weights``, ``convert``), :mod:`.load`
(``load_checkpoint``, ``checkpoint_plan``, ``load_weights``), :mod:`.state` (``Checkpoint``, ``CheckpointError``,
the pipeline's state), :mod:`~rpcompile.training.checkpoint.background` (``PendingSave``), :mod:`.layout` (``checkpoints``, ``verify_path``);
the public ones are also ``rpcompile.<name>``.
"""

"""Integrations: rpcompile inside the training loops fine-tuners already use.

:mod:`.hf` — HF ``transformers.Trainer`` (and TRL's ``SFTTrainer``) with the model compiled into a pipeline: a one-line
switch, ``from rpcompile.integrations.hf import Trainer``. ``transformers`` and ``trl`` stay optional: importing this
package imports neither.
"""

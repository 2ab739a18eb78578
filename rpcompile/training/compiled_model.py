"""What a pipeline's stages hold of the model they were compiled from, and the check every call makes of it.

The stages hold the model's ``nn.Parameter`` objects and a graph that ``torch.export`` or ``torch.fx`` recorded in
the mode each module was in. Two user actions would then train or evaluate something other than what eager
PyTorch would, silently:

- **a parameter replaced** by a new ``nn.Parameter`` (``model.lm_head.weight = nn.Parameter(...)``,
  ``resize_token_embeddings``, weights tied afresh), **added** (an adapter) or **removed**: the stages would keep
  training the old objects and leave the new ones without gradients. Refused. Values changed in place
  (``load_state_dict``, ``p.copy_``) are what the stages read, and are fine;
- **the mode changed**: a trace records dropout's ``train`` flag, an attention kernel's ``dropout_p`` and batch
  norm's ``training`` as constants. Every module in eval mode after a train-mode trace is the one change the
  runtime can follow: its dropouts are switched off at run time (:mod:`rpcompile.runtime.rng`), so
  ``model.eval()`` evaluates as eager eval does. Another change is refused where the graph depends on the mode
  (a dropout that drops something, a recorded batch norm); a module called by an fx graph follows its model
  module's mode (:meth:`CompiledModel.follow` sets the stages' copies before every call).

:class:`CompiledModel` records both at compile time; :meth:`CompiledModel.check` raises
:class:`~rpcompile.core.errors.ModelChangedError` in one line, or returns the mode the stages run in.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..core.errors import ModelChangedError
from ..core.randomness import draws, mode_fixed

__all__ = ["CompiledModel"]


class CompiledModel:
    """The parameters and modes of ``model`` as compiled into the stages that run ``gm`` (module docstring)."""

    def __init__(self, model: torch.nn.Module, gm: fx.GraphModule):
        self.model = model
        # every name of a tied parameter: re-tying one name to a new Parameter shows as that name replaced
        self.parameters = dict(model.named_parameters(remove_duplicate=False))
        self.modes = {name: m.training for name, m in model.named_modules()}
        """Each module's mode when the model was traced (the model's own under the name "")."""
        self.mode_fixed = mode_fixed(gm)
        """Nodes the trace fixed to the traced mode that the runtime cannot switch (batch norms)."""
        self.randomness = [n.name for n in gm.graph.nodes if draws(gm, n)]
        """Random nodes that draw something (dropouts of probability above 0, attention dropout, ...)."""
        self._followed = dict(self.modes)
        """The modes the stages' modules were last put in (:meth:`follow`): the traced ones to start with."""

    def check(self) -> bool:
        """Refuse a changed model (module docstring); else the mode the stages run in (True: train)."""
        self._check_parameters()
        return self._training()

    def _training(self) -> bool:
        now = {name: m.training for name, m in self.model.named_modules()}
        traced = self.modes[""]
        if now == self.modes:
            return traced
        if traced and not any(now.values()) and not self.mode_fixed:
            return False  # eval after a train-mode trace: the dropouts off at run time
        if not (self.mode_fixed or self.randomness):
            return now[""]  # nothing the graph fixed depends on the mode; its modules follow theirs (follow())
        # the first module whose mode differs, to name in the message
        name = next(n for n, mode in now.items() if self.modes.get(n) != mode)
        mode, was = ("train", "eval") if now[name] else ("eval", "train")
        fixed = (f"its batch norm ({self.mode_fixed[0]}) runs as in {was} mode" if self.mode_fixed else
                 f"its dropouts ({self.randomness[0]}) were traced as in {was} mode")
        fix = ("call model.train() before rpcompile.compile (models load in eval mode)" if mode == "train" else
               f"put the whole model in one mode (model.eval() or model.train()), or compile it again in {mode} mode")
        raise ModelChangedError(f"the model changed after compile: {f'module {name}' if name else 'it'} is in {mode} "
                                f"mode but was traced in {was} mode, and {fixed}; {fix}")

    def follow(self, stages: list[fx.GraphModule]) -> None:
        """Put each module the stages call (their copies of the model's modules, under the model's names, inside
        a saved segment's module too) in the mode its model module is in now: a batch norm or dropout module of an fx graph then runs as eager does
        after ``model.eval()`` / ``model.train()``."""
        now = {name: m.training for name, m in self.model.named_modules()}
        # no mode changed since the last follow: nothing to walk
        if now == self._followed:
            return
        for gm in stages:
            for name, sub in gm.named_modules():
                while name and name not in now:  # inside a saved segment's module: its path after the segment's
                    name = name.partition(".")[2]
                if name:
                    sub.training = now[name]
        self._followed = now

    def _check_parameters(self) -> None:
        now = dict(self.model.named_parameters(remove_duplicate=False))
        # identity, not values: a new Parameter equal to the old one is still one the stages do not hold
        if now.keys() == self.parameters.keys() and all(now[n] is p for n, p in self.parameters.items()):
            return
        replaced = [n for n, p in self.parameters.items() if n in now and now[n] is not p]
        added = [n for n in now if n not in self.parameters]
        removed = [n for n in self.parameters if n not in now]
        what = (f"parameter {replaced[0]} was replaced by a new nn.Parameter" if replaced else
                f"parameter {added[0]} was added" if added else f"parameter {removed[0]} was removed")
        more = len(replaced) + len(added) + len(removed) - 1
        raise ModelChangedError(
            f"the model changed after compile: {what}{f' (and {more} more)' if more else ''}, but the pipeline "
            "trains the parameters it was compiled with; change values in place (with torch.no_grad(): "
            "p.copy_(new), or model.load_state_dict(...)) or compile the model again")

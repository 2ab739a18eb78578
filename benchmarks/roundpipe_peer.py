"""The real RoundPipe (PyPI ``roundpipe`` 0.1.1) as a peer of rpcompile on the same GPU (``gpu.py --peer roundpipe``).

RoundPipe pipelines an ``nn.Sequential``; for HuggingFace ``LlamaForCausalLM`` it ships a preset
(``roundpipe.models.llama``) that splits the model into prefix (embedding, mask, RoPE), one stage per decoder
layer, and postfix (norm, LM head, loss). So the peer runs on :func:`hf_twin`: an HF Llama of the very shape of
rpcompile's model with the very same weights (in bf16), fed the same tokens, split into the same microbatches,
under the same GPU memory cap, in the same process.

What is timed, for both systems: one forward + backward over the batch until every gradient is in host memory.
No optimizer step for either (rpcompile leaves it to any ``torch.optim`` optimizer; RoundPipe's runs on its own
thread and, in its default async mode, overlaps the next iteration). RoundPipe plans its stages with its own
planner (``ModelExecutePlan.auto``) under 0.6 × the cap, the fraction its default takes of a GPU's memory.

Two things make RoundPipe 0.1.1 run under transformers 5:
- its Llama preset calls ``create_causal_mask(input_embeds=...)``; transformers 5 names the argument
  ``inputs_embeds`` (and later releases ``past_key_values`` ``cache`` and drop ``cache_position``):
  :func:`causal_mask_shim` renames what the installed function names differently and drops what it no longer takes;
- its optimizers compile C++ with ninja on first use: not needed here (no optimizer step), so not imported.

``roundpipe`` is imported only by :func:`load_roundpipe`, i.e. only when ``--peer roundpipe`` is given: it needs
CUDA at import time (it enumerates the GPUs and reads their free memory) and the packages ``beartype`` and
``py-cpuinfo``. On the GPU machine (no network) put their wheels in ``.whl/`` beside roundpipe's.
"""

from __future__ import annotations

import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import shutil
import statistics
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.nn as nn

PEERS = ("roundpipe",)
GiB = 1 << 30

#: argument names RoundPipe 0.1.1 passes to ``create_causal_mask`` -> the names later transformers use
_MASK_RENAMES = {"input_embeds": "inputs_embeds", "past_key_values": "cache"}


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (no CUDA, or the package or one of its dependencies is missing)."""


def causal_mask_shim(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (transformers' ``create_causal_mask``) accepting RoundPipe 0.1.1's argument names: each keyword in
    ``_MASK_RENAMES`` that ``fn`` does not take but whose new name it does is renamed, and keywords ``fn`` does
    not take at all are dropped (unless it takes ``**kwargs``). A function that already takes the old names is
    returned unchanged."""
    params = inspect.signature(fn).parameters
    if "input_embeds" in params:  # a transformers that still speaks RoundPipe's names
        return fn
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(fn)
    def create_causal_mask(*args: Any, **kwargs: Any) -> Any:
        for old, new in _MASK_RENAMES.items():
            if old in kwargs and old not in params and new in params and new not in kwargs:
                kwargs[new] = kwargs.pop(old)
        if not open_kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return fn(*args, **kwargs)

    create_causal_mask.__rpcompile_shim__ = True  # type: ignore[attr-defined]
    return create_causal_mask


#: the mask builders RoundPipe's presets call with its names (the Qwen3 preset calls both with one set of kwargs)
_MASK_FUNCTIONS = ("create_causal_mask", "create_sliding_window_causal_mask")


def install_mask_shim(module: Any) -> bool:
    """Wrap each of ``module``'s mask builders (``_MASK_FUNCTIONS``; a RoundPipe preset module) in
    :func:`causal_mask_shim`, once. Returns whether the module's ``create_causal_mask`` is now a shim."""
    for name in _MASK_FUNCTIONS:
        fn = getattr(module, name, None)
        if fn is not None and not getattr(fn, "__rpcompile_shim__", False):
            shimmed = causal_mask_shim(fn)
            if shimmed is not fn:
                setattr(module, name, shimmed)
    return getattr(getattr(module, "create_causal_mask", None), "__rpcompile_shim__", False)


# --------------------------------------------------------------------------------------------- the HF twin
_NAMES = [  # rpcompile's Llama parameter names -> HF LlamaForCausalLM's
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^layers\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^layers\.(\d+)\.attn\.(q|k|v|o)_proj\.weight$", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"^layers\.(\d+)\.attn\.(q|k)_norm\.weight$", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"^layers\.(\d+)\.mlp_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
]


def hf_name(name: str) -> str:
    """The HF name of one of rpcompile's Llama parameters (``ValueError`` for one it has no counterpart for)."""
    for pattern, repl in _NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    raise ValueError(f"no HF Llama counterpart for parameter {name!r}")


def hf_twin(model: nn.Module, dtype: torch.dtype = torch.bfloat16, *, untie: bool = False) -> nn.Module:
    """An HF ``LlamaForCausalLM`` of ``model``'s shape (an :class:`rpcompile.models.Llama`; ``Qwen3ForCausalLM``
    when it has q/k norms, the Qwen3 shapes such as llama-1.7b) holding a copy of its weights in ``dtype``, on the
    CPU, built without HF's own init. RoundPipe has a preset for both classes. ``untie``: a tied model's
    ``lm_head`` becomes a weight of its own holding the same values — the same function, the head's gradient
    not summed into the embedding's."""
    import transformers  # here, not at the top: only --peer needs transformers

    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "n_layers"):
        raise PeerUnavailable("--peer roundpipe runs on rpcompile's Llama/Qwen3-shaped models (the llama presets, "
                              "e.g. llama-8b, llama-1.7b); this model has no HF twin")
    qwen3 = bool(getattr(cfg, "qk_norm", False))
    if qwen3 and not hasattr(transformers, "Qwen3Config"):
        raise PeerUnavailable(f"--peer roundpipe on a Qwen3 shape needs transformers with Qwen3 (>= 4.51); this is "
                              f"{transformers.__version__}")
    Config, Model = ((transformers.Qwen3Config, transformers.Qwen3ForCausalLM) if qwen3
                     else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    config = Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hd, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings and not untie,
        attention_bias=False, use_cache=False, **({"use_sliding_window": False} if qwen3 else {"mlp_bias": False}))
    config._attn_implementation = "sdpa"  # what rpcompile's Llama runs (F.scaled_dot_product_attention)
    with torch.device("meta"):  # no storage and no init: the weights come from `model`
        hf = Model(config)
    tied = cfg.tie_embeddings and not untie
    state = {hf_name(k): v.detach().to(dtype=dtype, copy=True) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings and not tied and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)  # the copies become the weights
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"HF twin does not match: missing {missing}, unexpected {unexpected}")
    if tied:
        hf.tie_weights()
    # the rotary tables are buffers, still on the meta device: build them afresh (fp32, on the CPU)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"HF twin left without values: {left}")
    if qwen3:  # RoundPipe's Qwen3 preset picks each layer's mask by `layer.attention_type`, gone in transformers 5
        types = getattr(config, "layer_types", None) or ["full_attention"] * cfg.n_layers
        for layer, kind in zip(hf.model.layers, types):
            if not hasattr(layer, "attention_type"):
                layer.attention_type = kind
    hf.eval()  # no dropout in either model; eval only silences HF's training-mode warnings
    return hf


# --------------------------------------------------------------------------------------------- the peer
#: what ``import roundpipe`` needs beside torch (PyPI names in brackets where they differ from the module's)
_NEEDS = {"roundpipe": "roundpipe==0.1.1", "beartype": "beartype", "cpuinfo": "py-cpuinfo", "tqdm": "tqdm",
          "transformers": "transformers"}


def check_roundpipe() -> None:
    """Raise :class:`PeerUnavailable` (one line) unless CUDA is there and RoundPipe and what it imports are
    installed. Imports nothing: importing roundpipe starts its threads and reads the GPUs."""
    if not torch.cuda.is_available():
        raise PeerUnavailable("--peer roundpipe needs a CUDA GPU (RoundPipe runs on CUDA only); none is available")
    missing = [pkg for mod, pkg in _NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise PeerUnavailable(f"--peer roundpipe: not installed: {', '.join(missing)} (pip install them, or "
                              "their wheels from .whl/: see benchmarks/README.md)")


def load_roundpipe() -> Any:
    """Import ``roundpipe`` (needs CUDA) with the causal-mask shim on its Llama preset. Raises
    :class:`PeerUnavailable` with one line saying what is missing."""
    check_roundpipe()
    if "RPP_DISABLE_TORCH_COMPILE" not in os.environ and shutil.which("cc") is None and shutil.which("gcc") is None:
        os.environ["RPP_DISABLE_TORCH_COMPILE"] = "1"  # its loss is torch.compile'd, and inductor needs a C compiler
    try:
        roundpipe = importlib.import_module("roundpipe")
        presets = [importlib.import_module(f"roundpipe.models.{m}") for m in ("llama", "qwen3")]
    except ImportError as e:
        raise PeerUnavailable(f"--peer roundpipe: cannot import roundpipe ({e}); install roundpipe==0.1.1 with "
                              "beartype and py-cpuinfo (pip install roundpipe==0.1.1, or their wheels from .whl/)")
    for preset in presets:
        install_mask_shim(preset)
    return roundpipe


class _Watchdog:
    """Ends the process if a RoundPipe step never returns: RoundPipe's device threads exit on an error (CUDA out of
    memory included) and leave the main thread waiting forever."""

    def __init__(self, seconds: float, what: str):
        self.timer = threading.Timer(seconds, self._fire, args=(seconds, what))
        self.timer.daemon = True

    def _fire(self, seconds: float, what: str) -> None:
        print(f"roundpipe peer: {what} did not finish in {seconds:.0f} s (a RoundPipe worker thread probably died; "
              "its traceback is above); the rows before it are already written", file=sys.stderr, flush=True)
        os._exit(3)

    def __enter__(self) -> "_Watchdog":
        self.timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.timer.cancel()


def roundpipe_row(spec: Any, *, device: str, microbatches: int, cap_gib: float, steps: int, label: str,
                  timeout_s: float = 900.0, release_source: bool = False) -> dict[str, Any]:
    """One row: RoundPipe on the HF twin of ``spec.model``, ``spec``'s tokens and targets, ``microbatches``
    microbatches, its planner limited to 0.6 × ``cap_gib`` (the caller caps the GPU itself). Median of ``steps``
    timed steps after two warm-ups (its planner re-plans from the times it measured). RoundPipe runs on every
    visible CUDA device (``device`` only labels the row): give the process one GPU. A failure (RoundPipe missing
    or failing to import included) is the row's ``error``, not an exception. ``release_source``: free
    ``spec.model``'s weights once the twin holds its copy (the caller's last use of them: on the 8B shape, fp32
    weights + the bf16 twin + RoundPipe's fp32 copies and gradients come near a 126 GiB host)."""
    row: dict[str, Any] = {"section": "capped", "system": "roundpipe", "variant": label, "device": device,
                           "gpus": torch.cuda.device_count(), "microbatches": microbatches, "step_s": None}
    try:
        roundpipe = load_roundpipe()
        row.update(roundpipe=importlib.metadata.version("roundpipe"),
                   torch_compile=os.environ.get("RPP_DISABLE_TORCH_COMPILE", "0") != "1")
        t0 = time.perf_counter()
        # untied: RoundPipe 0.1.1 computed a loss of 7.30 against 12.35 on the tied Qwen3-1.7B twin (H100,
        # 2026-11-28; the 8B twin, untied, matched to 4 digits), so it gets the same function with its own head
        hf = hf_twin(spec.model, untie=True)
        if release_source:
            for t in [*spec.model.parameters(), *spec.model.buffers()]:
                t.data = torch.empty(0, dtype=t.dtype)
            gc.collect()
        rp = roundpipe.wrap_model_to_roundpipe(
            hf, use_sequential_preset=True, optim_dtype=torch.float32, name="peer",
            model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=microbatches))
        row["setup_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported in the table: the rpcompile rows stand without it
        return row | {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    (x,), y = spec.example_inputs, spec.example_target
    inputs = {"input_ids": x, "labels": y, "shift_labels": y, "return_logits": False}  # y is already shifted
    stages: dict[str, int] = {}

    def step() -> float:
        rp.model_timer.update_times()
        plan = roundpipe.ModelExecutePlan.auto("fused", rp, model_memory_limit=cap_gib * 0.6)
        stages.update(forward=len(plan.fwd_plan), backward=len(plan.bwd_plan))
        t = time.perf_counter()
        loss = rp.forward_backward(input_kwargs=inputs, loss_fn=lambda out, _: out.loss / microbatches,
                                   run_config=roundpipe.RoundPipeRunConfig(execute_plan=plan))
        for attrs in rp.layer_attrs:  # every gradient is on the host
            attrs.grad_download_started.wait()
            attrs.grad_downloaded.synchronize()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        rp.synchronize()  # gradients into .grad, so the next step starts from none (untimed)
        hf.zero_grad(set_to_none=True)
        row["loss"] = float(loss)
        row.setdefault("losses", []).append(row["loss"])  # every step's, warm-ups included: no optimizer steps, so
        # they should all equal rpcompile's loss on the same weights and tokens (gpu._versus_peer checks the last)
        return elapsed

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        with _Watchdog(timeout_s, "a RoundPipe step"):
            step(), step()
            times = [step() for _ in range(steps)]
        row.update(step_s=statistics.median(times), peak_gib=torch.cuda.max_memory_allocated() / GiB, error=None,
                   stages=stages["forward"] + stages["backward"], plan=dict(stages))
    except Exception as e:  # noqa: BLE001 - reported in the table: the rpcompile rows stand without it
        row.update(step_s=None, peak_gib=torch.cuda.max_memory_allocated() / GiB,
                   error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    del rp, hf
    gc.collect()
    torch.cuda.empty_cache()
    return row

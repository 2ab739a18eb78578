"""LoRA fine-tuning with rpcompile and PEFT, end to end: the loop a user would copy.

A small HF Llama is built from a config (random weights: no hub access; load yours with ``from_pretrained``),
wrapped with PEFT LoRA adapters on the attention projections, compiled into a round-robin pipeline (two logical
CPU devices here, every GPU when CUDA is available), trained a few steps on right-padded batches with the
model's own causal-LM loss, then merged (``merge_and_unload``) and saved as a plain HF model.

    python examples/lora_finetune.py --steps 4 --out /tmp/merged

Only the adapters train: the base is frozen, so it needs no gradients and no optimizer state, and rpcompile keeps
it once on the host, in the compute precision (2 bytes a parameter in bf16; fp32 here on CPU devices).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import rpcompile


def padded_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Right-padded token ids of random lengths, their attention mask, and labels with -100 on the padding."""
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=generator)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (batch, seq), generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", default=None, help="where to save the merged model (default: a temporary directory)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2)
    base = LlamaForCausalLM(config)  # or LlamaForCausalLM.from_pretrained(...)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.print_trainable_parameters()
    model.train()  # from_pretrained loads in eval mode: trace in train mode so that lora_dropout trains

    g = torch.Generator().manual_seed(0)
    example = padded_batch(args.batch, args.seq, config.vocab_size, g)
    on_gpu = torch.cuda.is_available()
    pipe = rpcompile.compile(model, (), example_kwargs=example, loss_fn=None,  # the model's own loss
                             gpus=torch.cuda.device_count() if on_gpu else None,
                             devices=None if on_gpu else ["cpu", "cpu"], spec=None if on_gpu else "cpu")  # costs: measured on the GPU, analytic on CPUs
    print(f"planned {len(pipe.plan.stages)} stages on {len(pipe.devices)} devices")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    held_out = padded_batch(args.batch, args.seq, config.vocab_size, g)
    for step in range(args.steps):
        batch = padded_batch(args.batch, args.seq, config.vocab_size, g)  # any size, up to the compiled length
        loss = pipe.forward_backward(**batch)  # the labels are the target; gradients land in the adapters' .grad
        pipe.step(optimizer)                   # optimizer.step(); optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    model.eval()  # evaluation: dropout off, no gradients, the same microbatches as training
    print(f"held-out loss: {pipe.evaluate(**held_out).item():.4f}")

    merged = model.merge_and_unload()  # a plain LlamaForCausalLM with the adapters folded into its weights
    out = args.out or tempfile.mkdtemp(prefix="lora-merged-")
    merged.save_pretrained(out)
    print(f"merged model saved to {out}")


if __name__ == "__main__":
    main()

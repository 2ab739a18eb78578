"""HF Trainer through a pipeline (:mod:`rpcompile.integrations.hf`): the one-line switch trains an HF Llama from a
config like stock ``transformers.Trainer`` on eager — the logged loss, grad norm and learning rate at every step and
the weights at the end — with padded batches of several lengths, gradient accumulation, clipping and a cosine
schedule; evaluates like it; and resumes from its own checkpoint bit for bit, dropout included. TRL's
``SFTTrainer`` goes the same way."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch

import rpcompile
from _hf import VOCAB, hf_model
from test_runtime import FINE_CPU

from rpcompile.training.checkpoint.pipeline_file import read_pipeline

transformers = pytest.importorskip("transformers")
try:  # an older transformers beside this environment's newer datasets/hub (make test-compat) has no Trainer
    import transformers.trainer  # noqa: F401
except Exception as e:  # noqa: BLE001 - whatever the mismatch raises
    pytest.skip(f"transformers.Trainer does not import here ({type(e).__name__})", allow_module_level=True)
hf = pytest.importorskip("rpcompile.integrations.hf")

pytestmark = pytest.mark.hf

OPTIONS = hf.PipelineOptions(devices=["cpu", "cpu"], microbatches=2, spec=FINE_CPU, time_limit_s=2.0, max_length=12,
                             compile_kwargs={"host_embedding": False})


def dataset(n: int = 24, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token rows of 5 to 12 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 13, (n,), generator=g)
    return [{"input_ids": torch.randint(1, VOCAB, (int(k),), generator=g).tolist()} for k in lengths]


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded to the longest row; labels -100 on the padding."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def arguments(tmp_path, **kw) -> "transformers.TrainingArguments":
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-3, lr_scheduler_type="cosine",
                warmup_steps=1, max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    return transformers.TrainingArguments(**{**base, **kw})


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def test_the_trainer_trains_like_stock_trainer_on_eager(tmp_path):
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    data, held_out = dataset(), dataset(8, seed=1)
    ours = hf.Trainer(model=model, args=arguments(tmp_path / "ours"), train_dataset=data, eval_dataset=held_out,
                      data_collator=collate, pipeline=OPTIONS)
    stock = transformers.Trainer(model=ref, args=arguments(tmp_path / "stock"), train_dataset=data,
                                 eval_dataset=held_out, data_collator=collate)
    ours.train(), stock.train()
    for key in ("loss", "grad_norm", "learning_rate"):
        mine, theirs = logged(ours, key), logged(stock, key)
        assert len(mine) == len(theirs) == 3, key
        assert mine == pytest.approx(theirs, rel=1e-4), key
    assert min(logged(ours, "grad_norm")) > 0.5  # the clipping clipped
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert ours.pipe is not None and next(model.parameters()).device.type == "cpu"
    assert ours.evaluate()["eval_loss"] == pytest.approx(stock.evaluate()["eval_loss"], rel=1e-5)


def test_resume_from_a_trainer_checkpoint_is_bit_for_bit(tmp_path):
    """Four steps at once against two, a checkpoint, and two more in a new Trainer resumed from it: the same
    weights bit for bit — with dropout on, so the pipeline's own state (the iteration that seeds the masks) must
    come back with the checkpoint."""
    def model():
        m = hf_model("llama")
        m.config.attention_dropout = 0.1
        for layer in m.model.layers:
            layer.self_attn.attention_dropout = 0.1
        return m

    data = dataset()
    whole = model()
    hf.Trainer(model=whole, args=arguments(tmp_path / "whole", max_steps=4), train_dataset=data,
               data_collator=collate, pipeline=OPTIONS).train()
    first = model()
    hf.Trainer(model=first, args=arguments(tmp_path / "cut", max_steps=4, save_strategy="steps", save_steps=2),
               train_dataset=data, data_collator=collate, pipeline=OPTIONS).train()
    checkpoint = tmp_path / "cut" / "checkpoint-2"
    ours = checkpoint / hf.TRAINER_FOLDER
    assert sorted(f.name for f in ours.iterdir()) == ["pipeline.json", hf.TRAINER_PLAN_FILE]
    assert json.loads((ours / "pipeline.json").read_text())["iteration"] == 4  # readable text: 2 steps of 2 calls
    # the same checkpoint as an earlier version laid it out (plan and torch.save'd state beside the Trainer's files)
    old = tmp_path / "old" / "checkpoint-2"
    shutil.copytree(checkpoint, old)
    shutil.move(old / hf.TRAINER_FOLDER / hf.TRAINER_PLAN_FILE, old / "rpcompile_plan.json")
    torch.save(read_pipeline(ours), old / "rpcompile_pipeline.pt")
    shutil.rmtree(old / hf.TRAINER_FOLDER)
    for start in (checkpoint, old):
        resumed = model()
        trainer = hf.Trainer(model=resumed, args=arguments(start.parent, max_steps=4), train_dataset=data,
                             data_collator=collate, pipeline=OPTIONS)
        trainer.train(resume_from_checkpoint=str(start))
        for (name, p), q in zip(whole.named_parameters(), resumed.parameters()):
            assert torch.equal(p, q), f"{start.parent.name}: {name}"
    # a damaged state is refused in one line that says what to do
    (ours / "pipeline.json").write_text('{"format": ')
    trainer = hf.Trainer(model=model(), args=arguments(tmp_path / "cut", max_steps=4), train_dataset=data,
                         data_collator=collate, pipeline=OPTIONS)
    with pytest.raises(rpcompile.ConfigError, match=r"^the pipeline state in .*checkpoint-2 cannot be read "
                       r"\(pipeline.json is corrupt .*\): resume from another checkpoint, or delete its rpcompile "
                       r"folder to resume without it \(dropout then draws other masks\)$"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(Exception, match=r"^PipelineOptions\(precision='int8'\): use 'fp32', 'bf16' or 'fp16'$"):
        hf.PipelineOptions(precision="int8")
    with pytest.raises(Exception, match=r"^PipelineOptions\(compile_kwargs=\.\.\.\) sets \['loss_fn'\], which the "):
        hf.PipelineOptions(compile_kwargs={"loss_fn": None})


def test_a_peft_lora_model_trains_like_stock_trainer(tmp_path):
    """PEFT LoRA adapters on the Llama: the adapters after three steps and the logged losses equal stock's."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(hf_model("llama"), config)
    ref = copy.deepcopy(model)
    data = dataset()
    ours = hf.Trainer(model=model, args=arguments(tmp_path / "ours"), train_dataset=data, data_collator=collate,
                      pipeline=OPTIONS)
    stock = transformers.Trainer(model=ref, args=arguments(tmp_path / "stock"), train_dataset=data,
                                 data_collator=collate)
    ours.train(), stock.train()
    assert logged(ours, "loss") == pytest.approx(logged(stock, "loss"), rel=1e-4)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    for (name, p), q in zip(trained, [q for q in ref.parameters() if q.requires_grad]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def tokenizer():
    """A word-level tokenizer over the test vocabulary, built here (no hub)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def test_trl_sft_trainer_trains_like_stock_sft_trainer(tmp_path):
    """TRL's SFTTrainer with the same mixin (``sft_trainer()``) on a tokenized dataset: the logged losses and grad
    norms and the weights after three steps equal stock SFTTrainer's on eager. (SGD: TRL computes its loss through
    its own fused head, whose rounding differs from the model's by ~1e-5, which AdamW's first steps turn into
    lr-sized steps on the few weights whose gradient is ~0.)"""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list(dataset())
    model = hf_model("llama")
    ref = copy.deepcopy(model)

    def config(where):
        base = arguments(tmp_path / where).to_dict()
        keep = {k: base[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_steps",
                                      "learning_rate", "lr_scheduler_type", "warmup_steps", "max_grad_norm",
                                      "logging_steps", "report_to", "use_cpu", "save_strategy", "seed", "data_seed",
                                      "disable_tqdm", "dataloader_num_workers")}
        return trl.SFTConfig(output_dir=str(tmp_path / where), max_length=12, packing=False, optim="sgd", **keep)

    SFTTrainer = hf.sft_trainer()
    ours = SFTTrainer(model=model, args=config("ours"), train_dataset=data, processing_class=tokenizer(),
                      pipeline=OPTIONS)
    stock = trl.SFTTrainer(model=ref, args=config("stock"), train_dataset=data, processing_class=tokenizer())
    ours.train(), stock.train()
    for key in ("loss", "grad_norm"):
        assert logged(ours, key) == pytest.approx(logged(stock, key), rel=1e-4), key
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_each_training_log_carries_the_pipeline_s_measurements(tmp_path):
    """Every training log (what TensorBoard or W&B receive) has the calls' tokens/s and bubble since the last log,
    measured from the pipeline's own record of each call."""
    model = hf_model("llama")
    seen = []
    trainer = hf.Trainer(model=model, args=arguments(tmp_path, max_steps=2), train_dataset=dataset(),
                         data_collator=collate, pipeline=OPTIONS)
    trainer.train()
    trainer.pipe.on_step = seen.append
    batch = collate(dataset(4, seed=3))
    trainer.pipe.forward_backward(**batch)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert h["pipeline/tokens_per_second"] > 0 and 0 <= h["pipeline/bubble"] < 1
    (record,) = seen
    assert record.tokens == int(batch["attention_mask"].sum()) and record.wall_s > 0
    assert set(record.stage_s) == {s.name for s in trainer.pipe.plan.stages}


def test_overlapped_steps_are_the_pipeline_s_one_step_stale_steps(tmp_path):
    """``PipelineOptions(overlap=True)``: the Trainer's optimizer and scheduler steps run as ``pipe.step(...,
    overlap=True)`` — the same weights, bit for bit, as a hand-written loop of ``forward_backward`` (with the
    Trainer's batches and ``num_items_in_batch``), clipping and ``pipe.step(opt, overlap=True, scheduler=...)``;
    and not those of synchronous steps (one step stale)."""
    model = hf_model("llama")
    initial = copy.deepcopy(model.state_dict())
    batches = []

    def recording(rows):
        batches.append(collate(rows))
        return batches[-1]

    overlapped = dataclasses.replace(OPTIONS, overlap=True)
    trainer = hf.Trainer(model=model, args=arguments(tmp_path), train_dataset=dataset(), data_collator=recording,
                         pipeline=overlapped)
    trainer.train()
    assert len(batches) == 6 and logged(trainer, "learning_rate")[:2] == [0.0, 5e-3]

    by_hand = hf_model("llama")
    by_hand.load_state_dict(initial)
    pipe = rpcompile.compile(by_hand, (), loss_fn=None, example_kwargs=hf._padded(batches[0], 12),
                             **OPTIONS.kwargs())
    opt = torch.optim.AdamW(by_hand.parameters(), lr=5e-3, weight_decay=0.0, fused=True)  # the Trainer's default
    sched = transformers.get_scheduler("cosine", opt, num_warmup_steps=1, num_training_steps=3)
    for step in range(3):
        pair = batches[2 * step:2 * step + 2]
        n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in pair)
        for b in pair:
            pipe.forward_backward(**b, num_items=n)
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 0.5)
        pipe.step(opt, overlap=True, scheduler=sched)
    pipe.synchronize()
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters()):
        assert torch.equal(p, q), name

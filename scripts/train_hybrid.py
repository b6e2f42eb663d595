"""Distil a small hybrid (Gated DeltaNet + full attention) model from the default model, on CPU.

Writes a transformers `qwen3_5_text` model directory (config.json, model.safetensors in bf16, the default
model's tokenizer files and chat template) that `AutoModelForCausalLM.from_pretrained` loads. It exists so
SCR fidelity can be measured on a hybrid architecture without downloading hybrid weights.

Student: 4 layers (3 `linear_attention` : 1 `full_attention`, the Qwen3.5 pattern), hidden 256, tied
embeddings initialised from SmolLM2's embedding projected onto its top-256 principal directions.
Data: Python standard-library docstrings rendered as read_doc agent turns with the default chat template.
The workload corpus (`kvsplice.bench.workload.load_corpus`) is split by document: every 10th document is
held out; the other documents plus the docstrings of further stdlib modules are training text.
Loss: cross-entropy on the text, plus (on the first `--teacher-windows` windows, which the teacher labels
once before training) cross-entropy against the teacher's top-k next-token distribution.
Training is time-boxed (`--train-minutes`) and saves a checkpoint every `--save-every-minutes`.

Usage (the command used for models/hybrid-mini, see docs/HYBRID_MODEL.md):
    python scripts/train_hybrid.py --out models/hybrid-mini
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import random
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from kvsplice.bench.workload import CORPUS_MODULES, MIN_DOC_WORDS, SYSTEM_PROMPT, Document, load_corpus
from kvsplice.models.default_model import pull_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
HELD_OUT_EVERY = 10  # workload document n is held out when n % HELD_OUT_EVERY == 0


@dataclass(frozen=True)
class TrainConfig:
    """Every hyperparameter of one run (written next to the model as training_args.json)."""

    seed: int = 0
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4  # layer_types repeat [linear, linear, linear, full]
    seq_len: int = 512
    batch_size: int = 4
    loss_fraction: float = 0.5  # share of positions per window that get the (vocab-sized) output head
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    teacher_windows: int = 64  # training windows labelled by the teacher (top-k) before training
    teacher_top_k: int = 32
    teacher_weight: float = 0.5  # loss = (1 - w) * text CE + w * teacher CE on labelled windows
    eval_windows: int = 24
    train_minutes: float = 30.0
    save_every_minutes: float = 5.0
    expected_steps: int = 650  # length of the cosine schedule; training stops earlier at train_minutes
    # Slow, frozen per-head decay of the Gated DeltaNet layers (A_log, dt_bias): with transformers'
    # default init (A in [1, 16]) the decay per token is ~1e-3 and the short distillation keeps it
    # there, so the linear layers forget everything beyond a token or two and no state mode of SCR
    # can differ from another. Decay 0.93-0.997 per token makes the recurrent state carry context.
    slow_decay: bool = False


def student_config(train: TrainConfig, teacher_config) -> Qwen3_5TextConfig:
    """The hybrid's transformers config: Qwen3.5 text layout at toy size, SmolLM2 vocab and special ids."""
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (train.num_layers // 4)
    return Qwen3_5TextConfig(
        vocab_size=teacher_config.vocab_size, hidden_size=train.hidden_size,
        intermediate_size=train.intermediate_size, num_hidden_layers=train.num_layers, layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_key_head_dim=64, linear_num_value_heads=4, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25},
        bos_token_id=teacher_config.bos_token_id, eos_token_id=teacher_config.eos_token_id,
        pad_token_id=teacher_config.eos_token_id)


def extra_documents(known_texts: set[str]) -> list[Document]:
    """Docstrings (>= MIN_DOC_WORDS words) of stdlib modules outside CORPUS_MODULES, their public members and
    those members' public attributes (for classes), in sorted module order.

    Texts already in `known_texts` are skipped, so no held-out workload docstring leaks into training.
    Side effect: imports those modules (ones that fail to import are skipped)."""
    names = sorted(name for name in sys.stdlib_module_names
                   if not name.startswith("_") and name not in CORPUS_MODULES
                   and name not in ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle"))
    documents = []
    for module_name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
                members = [(module_name, module)] + [(f"{module_name}.{name}", getattr(module, name, None))
                                                     for name in sorted(vars(module)) if not name.startswith("_")]
                members += [(f"{title}.{name}", getattr(member, name, None)) for title, member in members
                            if inspect.isclass(member) for name in sorted(vars(member)) if not name.startswith("_")]
                texts = [(title, inspect.getdoc(member)) for title, member in members if member is not None]
        except Exception:  # noqa: BLE001 - any stdlib module that cannot be imported here is just skipped
            continue
        for title, text in texts:
            if text and text not in known_texts and len(text.split()) >= MIN_DOC_WORDS:
                known_texts.add(text)
                documents.append(Document(title=title, words=tuple(text.split())))
    return documents


def split_documents() -> tuple[list[Document], list[Document]]:
    """(training documents, held-out documents); held-out = every HELD_OUT_EVERY-th workload document."""
    corpus = load_corpus()
    held_out = [doc for number, doc in enumerate(corpus) if number % HELD_OUT_EVERY == 0]
    train = [doc for number, doc in enumerate(corpus) if number % HELD_OUT_EVERY != 0]
    known_texts = {" ".join(doc.words) for doc in corpus}
    return train + extra_documents(known_texts), held_out


def render_document(tokenizer, doc: Document, with_system: bool) -> list[int]:
    """Token ids of one read_doc agent step about `doc`, in the default chat template (workload-like)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if with_system else []
    messages += [
        {"role": "user", "content": f"What does {doc.title} do?"},
        {"role": "assistant", "content": f"<think>I should check {doc.title} next.</think>\n"
                                         f"Reading the documentation of {doc.title}."},
        {"role": "tool", "content": f"Documentation of {doc.title}:\n{' '.join(doc.words)}"},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


def make_windows(tokenizer, documents: list[Document], seq_len: int, seed: int) -> torch.Tensor:
    """[n_windows, seq_len] ids: documents shuffled (seeded), rendered, concatenated, cut (tail dropped)."""
    order = list(documents)
    random.Random(seed).shuffle(order)
    stream: list[int] = []
    for number, doc in enumerate(order):
        stream.extend(render_document(tokenizer, doc, with_system=number % 4 == 0))
    n_windows = len(stream) // seq_len
    return torch.tensor(stream[: n_windows * seq_len], dtype=torch.long).view(n_windows, seq_len)


@torch.no_grad()
def teacher_top_k(teacher, windows: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher's top-k next-token (logits, ids) per position: [n, seq_len, top_k] each (logits fp32).

    One window at a time, so memory stays at one window's vocab-sized logits."""
    all_logits, all_ids = [], []
    for window in windows:
        logits = teacher(input_ids=window[None]).logits[0].float()
        values, ids = logits.topk(top_k, dim=-1)
        all_logits.append(values)
        all_ids.append(ids)
    return torch.stack(all_logits), torch.stack(all_ids)


def projected_embedding(teacher_embedding: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Teacher embedding [vocab, d] projected onto its top `hidden_size` principal directions.

    Rescaled to the teacher embedding's overall std so tied logits start at the teacher's scale."""
    centred = teacher_embedding - teacher_embedding.mean(dim=0, keepdim=True)
    # Principal directions = eigenvectors of the d x d covariance (d = 576: cheap, exact).
    eigenvalues, eigenvectors = torch.linalg.eigh(centred.T @ centred)
    top = eigenvectors[:, eigenvalues.argsort(descending=True)[:hidden_size]]
    projected = teacher_embedding @ top
    return projected * (teacher_embedding.std() / projected.std())


def build_student(train: TrainConfig, teacher) -> Qwen3_5ForCausalLM:
    """A freshly initialised student (seeded) with the projected teacher embedding (tied to lm_head)."""
    torch.manual_seed(train.seed)
    student = Qwen3_5ForCausalLM(student_config(train, teacher.config))
    with torch.no_grad():
        embedding = projected_embedding(teacher.get_input_embeddings().weight.float(), train.hidden_size)
        student.get_input_embeddings().weight.copy_(embedding)
        # Qwen3.5's RMSNorm scales by (1 + weight): -0.9 starts the final norm at 0.1, so the tied logits of a
        # fresh model are near uniform (at scale 1.0 it predicts its own input token with ~26 nats of loss).
        student.model.norm.weight.fill_(-0.9)
        if train.slow_decay:
            _freeze_slow_decay(student)
    return student


def _freeze_slow_decay(student) -> None:
    """Set every linear layer's A in [0.005, 0.1] and dt_bias 0 (decay exp(-A * softplus(a)) ~ 0.93-0.997
    per token at a = 0; Gated DeltaNet, Yang et al. 2025, eq. for alpha_t) and freeze both."""
    for layer in student.model.layers:
        attn = getattr(layer, "linear_attn", None)
        if attn is None:
            continue
        heads = attn.A_log.numel()
        attn.A_log.copy_(torch.linspace(0.005, 0.1, heads).log())
        attn.dt_bias.zero_()
        attn.A_log.requires_grad_(False)
        attn.dt_bias.requires_grad_(False)


def window_loss(student, ids: torch.Tensor, positions: torch.Tensor, teacher_logits: Optional[torch.Tensor],
                teacher_ids: Optional[torch.Tensor], teacher_weight: float) -> torch.Tensor:
    """Mean loss over `positions` (offsets predicting offset + 1) of a [batch, seq_len] batch.

    Text CE against ids[:, positions + 1]; if teacher top-k is given ([batch, seq_len, k]), mixed with the CE
    against the teacher's top-k distribution (renormalised softmax over its k logits)."""
    hidden = student.model(input_ids=ids).last_hidden_state[:, positions]
    log_probs = F.log_softmax(student.lm_head(hidden).float(), dim=-1)
    text_loss = -log_probs.gather(-1, ids[:, positions + 1, None]).mean()
    if teacher_logits is None or teacher_ids is None:
        return text_loss
    target = F.softmax(teacher_logits[:, positions], dim=-1)
    teacher_loss = -(target * log_probs.gather(-1, teacher_ids[:, positions])).sum(-1).mean()
    return (1 - teacher_weight) * text_loss + teacher_weight * teacher_loss


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, teacher_argmax: torch.Tensor) -> dict[str, float]:
    """Held-out text CE (nats/token), perplexity, and next-token top-1 agreement with the teacher.

    Every position except the last of each window counts; `teacher_argmax` is [n, seq_len]."""
    total_loss, total_agree, count = 0.0, 0, 0
    for window, argmax in zip(windows, teacher_argmax):
        logits = model(input_ids=window[None]).logits[0, :-1].float()
        total_loss += F.cross_entropy(logits, window[1:], reduction="sum").item()
        total_agree += (logits.argmax(-1) == argmax[:-1]).sum().item()
        count += window.numel() - 1
    loss = total_loss / count
    return {"loss": loss, "perplexity": math.exp(loss), "top1_agreement": total_agree / count}


def learning_rate(train: TrainConfig, step: int) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * lr over expected_steps (held there after)."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.expected_steps - train.warmup_steps))
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_model(student, out_dir: Path, tokenizer_dir: Path, train: TrainConfig, metrics: dict) -> int:
    """Write `student`'s weights in bf16 (transformers loads them as float32 unless asked for another dtype),
    the tokenizer files and the run's args/metrics to `out_dir`.

    Written to a sibling temp dir first, then swapped in, so `out_dir` is always a complete model.
    Returns the directory's total size in bytes."""
    staging = out_dir.with_name(out_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    # lm_head.weight is tied to the embedding: leave it out so the file holds the 49152 x 256 matrix once.
    state = {name: tensor.to(torch.bfloat16) for name, tensor in student.state_dict().items()
             if name != "lm_head.weight"}
    student.save_pretrained(staging, state_dict=state)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, staging / name)
    (staging / "training_args.json").write_text(json.dumps(asdict(train), indent=2) + "\n")
    (staging / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return sum(path.stat().st_size for path in out_dir.iterdir())


def sample_batch(rng: torch.Generator, windows: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Offsets of `batch_size` distinct windows drawn with `rng`."""
    return torch.randperm(len(windows), generator=rng)[:batch_size]


def train_loop(train: TrainConfig, student, train_windows: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor],
               evaluate_now, save_now) -> None:
    """Time-boxed AdamW training; every 3rd step is a teacher-labelled batch. Saves every save_every_minutes.

    `evaluate_now(step)` returns a metrics dict; `save_now(metrics)` writes the checkpoint."""
    teacher_logits, teacher_ids = labels
    labelled = train_windows[: len(teacher_logits)]
    rng = torch.Generator().manual_seed(train.seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                  betas=(0.9, 0.95))
    n_positions = int((train.seq_len - 1) * train.loss_fraction)
    start = last_save = time.time()
    step = 0
    while time.time() - start < train.train_minutes * 60:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(train, step)
        positions = torch.randperm(train.seq_len - 1, generator=rng)[:n_positions].sort().values
        if step % 3 == 2 and len(labelled):
            offsets = sample_batch(rng, labelled, train.batch_size)
            loss = window_loss(student, labelled[offsets], positions, teacher_logits[offsets], teacher_ids[offsets],
                               train.teacher_weight)
        else:
            offsets = sample_batch(rng, train_windows, train.batch_size)
            loss = window_loss(student, train_windows[offsets], positions, None, None, 0.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} lr {learning_rate(train, step):.2e} "
                  f"elapsed {time.time() - start:.0f}s", flush=True)
        if time.time() - last_save > train.save_every_minutes * 60:
            student.eval()
            save_now(evaluate_now(step, time.time() - start))
            student.train()
            last_save = time.time()
    student.eval()
    save_now(evaluate_now(step, time.time() - start))


def parse_args() -> tuple[TrainConfig, Path]:
    """TrainConfig fields as --flags (defaults = the documented run) and --out (model directory)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models/hybrid-mini"))
    for name, default in asdict(TrainConfig()).items():
        kind = (lambda text: text.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    args = vars(parser.parse_args())
    out_dir = args.pop("out")
    return TrainConfig(**args), out_dir


def main() -> None:
    """Prepare data and teacher labels, train, checkpoint; prints progress and the final metrics."""
    train, out_dir = parse_args()
    torch.set_num_threads(1)  # the machine's 2 cores are shared: multi-threaded BLAS thrashes (10x slower)
    torch.manual_seed(train.seed)
    teacher_dir = Path(pull_default_model())
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    train_docs, held_out_docs = split_documents()
    train_windows = make_windows(tokenizer, train_docs, train.seq_len, train.seed)
    eval_windows = make_windows(tokenizer, held_out_docs, train.seq_len, train.seed)[: train.eval_windows]
    print(f"{len(train_docs)} training docs -> {tuple(train_windows.shape)} windows; "
          f"{len(held_out_docs)} held-out docs -> {tuple(eval_windows.shape)}", flush=True)
    clock = time.time()
    eval_argmax = teacher_top_k(teacher, eval_windows, 1)[1][..., 0]
    labels = teacher_top_k(teacher, train_windows[: train.teacher_windows], train.teacher_top_k)
    label_seconds = time.time() - clock
    teacher_metrics = evaluate(teacher, eval_windows, eval_argmax)
    print(f"teacher labels {label_seconds:.0f}s; teacher held-out {teacher_metrics}", flush=True)
    student = build_student(train, teacher)
    del teacher
    untrained = evaluate(student, eval_windows, eval_argmax)
    print(f"untrained student {untrained}", flush=True)
    history: list[dict] = []

    def evaluate_now(step: int, seconds: float) -> dict:
        metrics = {"step": step, "train_seconds": round(seconds, 1), **evaluate(student, eval_windows, eval_argmax)}
        history.append(metrics)
        print(f"eval {metrics}", flush=True)
        return {"teacher_label_seconds": round(label_seconds, 1), "teacher": teacher_metrics,
                "untrained": untrained, "history": history,
                "data": {"train_windows": len(train_windows), "eval_windows": len(eval_windows),
                         "seq_len": train.seq_len}}

    def save_now(metrics: dict) -> None:
        print(f"saved {out_dir} ({save_model(student, out_dir, teacher_dir, train, metrics)} bytes)", flush=True)

    train_loop(train, student, train_windows, labels, evaluate_now, save_now)


if __name__ == "__main__":
    main()

"""The fact-tracking task: does the answer follow the current fact, or a stale or deleted one?

Agent transcripts like the edit cases' (`kvsplice.bench.edit_cases`), with one passphrase planted
in a tool result or in the working notes. Turn 2 edits the context, then asks for it, and the
assistant's answer is started for the model, so the next token is the answer (a small model
answers such questions by copying; with several passphrases in view the default model copies the
wrong one as often as the right one, so each transcript holds one):

    turn 1   [sys][task][notes][call][result][call][result ... the B vault is cobalt ...][call][result] ...
    turn 2   ...edited...[REPLY][user: What is the passphrase for the B vault? ...][assistant: The passphrase
             for the B vault is]  -> next token: " cobalt"?

Kinds of question (the fact asked about, and how turn 2 changed it):

    update_result   its tool result rewritten in place with a new value      current: new, stale: old
    update_note     its line in the notes rewritten with a new value         current: new, stale: old
    delete_result   its tool call and result deleted                         current: none, stale: the deleted
    replace_note    its result replaced by a one-line note without it        current: none, stale: the deleted
    keep            an earlier result deleted; the fact itself relocated     current: the fact, stale: none

Every value starts with a token of its own, so "follows" is the top-1 next token: the first token
of the current value, or of the stale one. Per setting (exact recompute, SCR as it is, SCR with
selective recompute, and the fp8 K/V anchors as a reference) and kind: how often the answer follows
the current value, how often the stale or deleted one, the probabilities of both, and KL(exact || SCR)
at the answer position.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvsplice.bench.edit_cases import REPLY_PLACEHOLDER, EditCase
from kvsplice.bench.fidelity import BASE_K, BASE_TAIL, Harness, Setting, compare
from kvsplice.bench.workload import SYSTEM_PROMPT, load_corpus, take_words

VAULTS = ("north", "harbor", "summit", "river", "garden", "tower", "canyon", "meadow", "island", "forest")
# one-token values (with their leading space) in SmolLM2's vocabulary; any tokenizer works, a
# value's first token is what is scored
VALUES = ("amber", "cobalt", "saffron", "quartz", "walnut", "indigo", "basil", "coral", "maple", "hazel",
          "ivory", "copper", "violet", "lantern", "falcon", "orchid", "pepper", "silver")
KINDS = ("update_result", "update_note", "delete_result", "replace_note", "keep")
RESULT_WITH_FACT, EARLIER_RESULT = 2, 1   # tool results, counted from 0
QUESTION = ("Before the next tool call, look back at the documentation and the working notes above: the next "
            "step of the task needs one detail from them. What is the passphrase for the {vault} vault? Answer "
            "with the passphrase only, exactly as it is written above.")
ANSWER = "The passphrase for the {vault} vault is"


@dataclass(frozen=True)
class FactCase:
    """One question: the two-turn case (its answer prefix starts the answer), its kind, the value
    that is current in turn 2 (None: deleted) and the stale one (None: nothing stale)."""

    case: EditCase
    kind: str
    current: Optional[str]
    stale: Optional[str]


def _fact(vault: str, value: str) -> str:
    return f"The passphrase for the {vault} vault is {value}."


def _plant(text: str, sentence: str, rng: random.Random) -> str:
    """`sentence` inserted between two words of `text`, 30-60% of the way in."""
    words = text.split(" ")
    at = rng.randint(len(words) * 3 // 10, len(words) * 6 // 10)
    return " ".join(words[:at] + [sentence] + words[at:])


def _transcript(rng: random.Random, vault: str, value: str, in_notes: bool, steps: int = 5,
                 result_words: int = 170) -> list[dict]:
    """System, task, notes, then `steps` calls and results; `vault` = `value` is planted in the
    notes (`in_notes`) or in tool result RESULT_WITH_FACT."""
    corpus = load_corpus()
    _, task = take_words(rng, corpus, 14)
    notes = f"- passphrase for the {vault} vault: {value}" if in_notes else "- (none yet)"
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Task: explain how these fit together, citing the docs. Context: {task}"},
                {"role": "user", "content": f"Working notes:\n{notes}"}]
    for step in range(steps):
        _, reasoning = take_words(rng, corpus, 30)
        title, result = take_words(rng, corpus, result_words)
        if step == RESULT_WITH_FACT and not in_notes:
            result = _plant(result, _fact(vault, value), rng)
        messages.append({"role": "assistant", "content": f"<think>I should check {title} next. {reasoning}</think>\n"
                                                          f"read_doc({json.dumps({'name': title})})"})
        messages.append({"role": "tool", "content": f"Documentation of {title}:\n{result}"})
    return messages


def _result_offset(messages: list[dict], number: int) -> int:
    return [offset for offset, m in enumerate(messages) if m["role"] == "tool"][number]


def _edit(kind: str, messages: list[dict], vault: str, old: str, new: str) -> tuple[list[dict], Optional[str]]:
    """Turn 2's messages for `kind` and the value current in them (None: deleted)."""
    fact_at = _result_offset(messages, RESULT_WITH_FACT)
    if kind == "update_result":
        edited = dict(messages[fact_at], content=messages[fact_at]["content"].replace(_fact(vault, old), _fact(vault, new)))
        return messages[:fact_at] + [edited] + messages[fact_at + 1:], new
    if kind == "update_note":
        notes = dict(messages[2], content=f"Working notes:\n- passphrase for the {vault} vault: {new}")
        return messages[:2] + [notes] + messages[3:], new
    if kind == "delete_result":
        return messages[: fact_at - 1] + messages[fact_at + 1:], None
    if kind == "replace_note":
        gist = " ".join(messages[fact_at]["content"].split()[:12])
        note = dict(messages[fact_at], content=f"[note] Result removed to save context. It began: {gist} ...")
        return messages[:fact_at] + [note] + messages[fact_at + 1:], None
    earlier = _result_offset(messages, EARLIER_RESULT)
    return messages[: earlier - 1] + messages[earlier + 1:], old


def fact_cases(seed: int = 0, per_kind: int = 4) -> list[FactCase]:
    """`per_kind` questions of every kind (KINDS), each on its own transcript; deterministic for
    `seed` on a Python build."""
    cases = []
    for number in range(per_kind):
        for kind in KINDS:
            rng = random.Random(f"kvsplice-facts:{seed}:{number}:{kind}")
            vault = rng.choice(VAULTS)
            old, new = rng.sample(VALUES, 2)
            turn1 = _transcript(rng, vault, old, in_notes=kind == "update_note")
            edited, current = _edit(kind, turn1 + [{"role": "assistant", "content": REPLY_PLACEHOLDER}], vault, old, new)
            turn2 = edited + [{"role": "user", "content": QUESTION.format(vault=vault)}]
            case = EditCase(f"{kind}-{number}", tuple(turn1), tuple(turn2), ANSWER.format(vault=vault))
            cases.append(FactCase(case, kind, current, None if kind == "keep" else old))
    return cases


# ----- scoring ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FactResult:
    """One question under one setting: whether the top-1 answer token is the current / stale
    value's first token, their probabilities, and KL(exact || setting) at the answer position
    (0 for exact recompute itself) and over the last positions; `computed_share`: the share of
    the prompt computed (1 for exact recompute)."""

    setting: str
    case: str
    kind: str
    follows_current: bool
    follows_stale: bool
    p_current: float
    p_stale: float
    kl_answer: float
    kl_mean: float
    computed_share: float = 1.0


def first_token(tokenizer, value: Optional[str]) -> Optional[int]:
    """The first token id of " value" (None for None)."""
    return None if value is None else tokenizer.encode(f" {value}", add_special_tokens=False)[0]


def score(setting: str, fact: FactCase, logits: torch.Tensor, tokenizer, kl_answer: float,
          kl_mean: float, computed_share: float = 1.0) -> FactResult:
    """A FactResult from the answer position's raw `logits [vocab]`."""
    probs = torch.softmax(logits.double(), dim=-1)
    top = int(probs.argmax())
    current, stale = first_token(tokenizer, fact.current), first_token(tokenizer, fact.stale)
    return FactResult(setting, fact.case.name, fact.kind, top == current, top == stale,
                      float(probs[current]) if current is not None else 0.0,
                      float(probs[stale]) if stale is not None else 0.0, kl_answer, kl_mean, computed_share)


def run_facts(harness: Harness, settings: Sequence[Setting], facts: Sequence[FactCase], log=print,
              anchor: bool = False) -> list[FactResult]:
    """Every setting and exact recompute on every question;
    with `anchor`, also the fp8 K/V anchors (`Harness.fp8`: turn 2's exact K/V stored in fp8, a
    full prefill, so computed share 1), after the settings."""
    results = []
    for fact in facts:
        started, first = time.perf_counter(), len(results)
        outputs = harness.case_outputs(fact.case, settings)
        turn2_ids = outputs[0][0]
        exact = harness.exact(turn2_ids)
        answer = max(exact.prompt_logits)
        results.append(score("exact", fact, exact.prompt_logits[answer], harness.tokenizer, 0.0, 0.0))
        for setting, (ids, out) in zip(settings, outputs):
            row = harness.result(setting, fact.case, ids, out)
            results.append(score(setting.label, fact, out.prompt_logits[answer], harness.tokenizer,
                                 row.kl_answer, row.kl_mean, row.computed_tokens / row.prompt_tokens))
        for label, out in (harness.fp8(turn2_ids).items() if anchor else ()):
            row = compare(label, fact.case.name, exact, out)
            results.append(score(label, fact, out.prompt_logits[answer], harness.tokenizer, row.kl_answer, row.kl_mean))
        log(f"{fact.case.name}: " + ", ".join(f"{r.setting} {'C' if r.follows_current else 'S' if r.follows_stale else '-'}"
                                              f" KL {r.kl_answer:.4f}" for r in results[first:])
            + f"  ({time.perf_counter() - started:.1f} s)")
    return results


def facts_table(results: Sequence[FactResult]) -> str:
    """Per setting and kind (and all kinds): questions, answers following the current value, the
    stale one, mean probabilities, mean answer-position KL, mean KL over the last positions and
    the mean share of the prompt computed."""
    lines = ["| setting | kind | questions | follows current | follows stale/deleted | p(current) | p(stale) | "
             "answer KL | mean KL | computed |", "|---|---|---|---|---|---|---|---|---|---|"]
    settings = list(dict.fromkeys(r.setting for r in results))
    for setting in settings:
        for kind in KINDS + ("all",):
            rows = [r for r in results if r.setting == setting and kind in (r.kind, "all")]
            if not rows:
                continue
            n = len(rows)
            with_current = [r for r in rows if r.kind in ("update_result", "update_note", "keep")]
            with_stale = [r for r in rows if r.kind != "keep"]
            lines.append(
                f"| {setting} | {kind} | {n} | {_share(with_current, 'follows_current')} | "
                f"{_share(with_stale, 'follows_stale')} | {_mean(with_current, 'p_current')} | "
                f"{_mean(with_stale, 'p_stale')} | {sum(r.kl_answer for r in rows) / n:.4f} | "
                f"{sum(r.kl_mean for r in rows) / n:.5f} | {100 * sum(r.computed_share for r in rows) / n:.1f}% |")
    return "\n".join(lines)


def _share(rows, key: str) -> str:
    return f"{sum(getattr(r, key) for r in rows)}/{len(rows)}" if rows else "-"


def _mean(rows, key: str) -> str:
    return f"{sum(getattr(r, key) for r in rows) / len(rows):.3f}" if rows else "-"


def fact_settings(default, seams: Sequence[int] = (), removed_seams: Sequence[int] = ()) -> list[Setting]:
    """The settings of the fact task: SCR without selective recompute (K=6, tail=16), the server
    default `default` (a ReuseConfig, its message openings included), K=6, tail=16 with each seam
    length of `seams`, and the default's seams with each longer seam of `removed_seams` after
    removed text."""
    removed = f", {default.removed_seam_tokens} after removed" if default.removed_seam_tokens else ""
    openings = f", openings {default.message_start_tokens}" if default.message_start_tokens else ""
    return ([Setting(f"K={BASE_K} tail={BASE_TAIL}", BASE_K, BASE_TAIL),
             Setting(f"default (seams {default.seam_tokens}{removed}{openings})",
                     default.max_spans, default.tail, seam_tokens=default.seam_tokens,
                     removed_seam_tokens=default.removed_seam_tokens,
                     message_start_tokens=default.message_start_tokens)]
            + [Setting(f"seams {n}", BASE_K, BASE_TAIL, seam_tokens=n) for n in seams]
            + [Setting(f"seams {default.seam_tokens}, {r} after removed", BASE_K, BASE_TAIL,
                       seam_tokens=default.seam_tokens, removed_seam_tokens=r)
               for r in removed_seams if r > default.seam_tokens])


def select_facts(facts: Sequence[FactCase], names: Optional[Sequence[str]]) -> list[FactCase]:
    """`facts` limited to the question names `names` (e.g. "delete_result-0"; None: all); a
    ValueError names unknown ones."""
    if not names:
        return list(facts)
    unknown = sorted(set(names) - {fact.case.name for fact in facts})
    if unknown:
        raise ValueError(f"unknown question(s) {unknown}; known: {[fact.case.name for fact in facts]}")
    return [fact for fact in facts if fact.case.name in names]

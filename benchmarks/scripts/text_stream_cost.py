"""The decoding loop's text stream (eaglespec.decode.TextStream) against decoding every token at every step, with
SmolLM2-135M's tokenizer: ms per pushed token over answers of N tokens pushed one at a time.

    python benchmarks/scripts/text_stream_cost.py [--tokens 256,1024]
"""

import argparse
import time

from eaglespec.decode import TextStream
from eaglespec.models import load_target

p = argparse.ArgumentParser()
p.add_argument("--tokens", default="256,1024")
args = p.parse_args()
_, tokenizer = load_target("smollm2-135m")
text = ("Speculative decoding drafts a few tokens with a small model and checks them all in one pass of the large "
        "one, keeping the longest correct prefix. ") * 100
ids = tokenizer(text)["input_ids"]


class EveryToken(TextStream):
    """The stream as it was before session 18: the whole decode at every step."""

    def text(self) -> str:
        return self._decode(self.tokens)


print("| tokens | decode all every step (ms/token) | anchored stream (ms/token) | same text |\n|---|---|---|---|")
for n in (int(v) for v in args.tokens.split(",")):
    results = {}
    for cls in (EveryToken, TextStream):
        stream, pieces = cls(tokenizer, []), []
        start = time.perf_counter()
        for token in ids[:n]:
            pieces.append(stream.push([token]))
        pieces.append(stream.flush())
        results[cls] = ((time.perf_counter() - start) * 1e3 / n, "".join(pieces))
    (old_ms, old_text), (new_ms, new_text) = results[EveryToken], results[TextStream]
    print(f"| {n} | {old_ms:.3f} | {new_ms:.3f} | {old_text == new_text == tokenizer.decode(ids[:n])} |")

"""Builds the kit's random models at real shapes (or tiny ones for the dry run), once per run.

    python benchmarks/gpu/buildmodels.py WORK_DIR TOKENIZER_DIR DATA '{"llama": "tinyllama-1.1b", ...}'

Without a tokenizer in TOKENIZER_DIR (the dry run, when prepare.sh was not run) a small BPE
tokenizer is trained on DATA's text first. Prints `RESULT {"llama": "WORK_DIR/tinyllama-1.1b", ...}`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCHMARKS))

import shapes  # noqa: E402  (benchmarks/shapes.py)
import throughput  # noqa: E402


def main() -> None:
    work, tokenizer, data = (Path(a) for a in sys.argv[1:4])
    wanted = json.loads(sys.argv[4])
    if not (tokenizer / "tokenizer.json").exists():
        from llmcustoms.data.dataset import usable_examples

        texts = [m.content for e in usable_examples(data) for m in e.messages]
        throughput.toy_tokenizer(texts).save_pretrained(tokenizer)
    built = {key: str(shapes.build(shape, work / shape, tokenizer)) for key, shape in wanted.items()}
    print("RESULT " + json.dumps(built), flush=True)


if __name__ == "__main__":
    main()

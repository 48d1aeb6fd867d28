"""Write one encoded golden sample per schema version: ``python -m tests.golden.make_golden``.

Run it only when adding a new schema (or version): existing files are the permanent
record of what old writers produced, and are never rewritten.
"""

from __future__ import annotations

from pathlib import Path

from bus.codec import encode, tag_of
from tests.samples import every_event

HERE = Path(__file__).parent


def golden_path(tag: str) -> Path:
    return HERE / (tag.replace("/", ".v") + ".msgpack")


def main() -> None:
    for event in every_event():
        path = golden_path(tag_of(type(event)))
        if path.exists():
            continue
        path.write_bytes(encode(event))
        print("wrote", path)


if __name__ == "__main__":
    main()

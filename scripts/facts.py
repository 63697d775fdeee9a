"""The counts the docs state, generated rather than typed: `python scripts/facts.py` writes them into the pages,
`python scripts/facts.py --check` says which page is stale (tests/test_facts.py runs it).

    python scripts/facts.py            # after adding tests or families
    python scripts/facts.py --check    # exit 1, naming each stale fact and the command that mends it

Each fact is a sentence of a page with its number in it, found by a pattern, and the function that counts it now: the
supported families (the family table) and the tests of the suite and of its fast tier (pytest's collection).
Times are not facts of this kind: they are measured, with the date of the measurement beside them.
"""

import argparse
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent


def collected(*marker: str) -> int:
    """How many tests pytest collects (with `-m MARKER` where given), in a process of its own."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *marker]
    listing = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, check=True).stdout
    return sum(1 for line in listing.splitlines() if "::" in line)


def supported_families() -> int:
    sys.path.insert(0, str(REPOSITORY))
    from attnres.families import SUPPORTED_FAMILIES

    return len(SUPPORTED_FAMILIES)


# (page, pattern whose groups are the numbers, the functions that count them now)
FACTS: list[tuple[str, str, tuple[Callable[[], int], ...]]] = [
    ("README.md", r"converts a pretrained checkpoint of (\d+) decoder families", (supported_families,)),
    ("docs/tests.md", r"(\d+) of (\d+) tests are in the fast tier", (lambda: collected("-m", "not slow"), collected)),
]


def stale_facts(write: bool) -> list[str]:
    """The facts whose numbers differ from the counts now, as 'page: stated -> counted'; written over with `write`."""
    stale = []
    for page, pattern, counts in FACTS:
        path = REPOSITORY / page
        text = path.read_text(encoding="utf-8")
        match = re.search(pattern, text)
        if match is None:
            raise SystemExit(f"{page}: no sentence matches {pattern!r}; put it back, or change FACTS in {__file__}")
        counted = [str(count()) for count in counts]
        if list(match.groups()) == counted:
            continue
        stale.append(f"{page}: {', '.join(match.groups())} -> {', '.join(counted)}")
        if write:
            fresh = match.group(0)
            for index in range(len(counted), 0, -1):  # from the last group, so that earlier offsets stay valid
                start, end = match.start(index) - match.start(0), match.end(index) - match.start(0)
                fresh = fresh[:start] + counted[index - 1] + fresh[end:]
            path.write_text(text[: match.start(0)] + fresh + text[match.end(0) :], encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page states a stale count")
    args = parser.parse_args(argv)
    stale = stale_facts(write=not args.check)
    for line in stale:
        print(("stale: " if args.check else "updated: ") + line)
    if args.check and stale:
        print("run `python scripts/facts.py` to write the counts into the pages", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

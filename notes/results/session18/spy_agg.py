"""Sum a py-spy raw profile (folded stacks) over the stacks inside a named function: self and inclusive shares.

python notes/results/session18/spy_agg.py PROFILE.raw FUNCTION [TOP]
"""

import sys
from collections import Counter


def main():
    path, marker = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    own, incl, lines, total = Counter(), Counter(), Counter(), 0
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        if not any(f.startswith(marker + " ") for f in frames):
            continue
        n = int(n)
        total += n
        lines[frames[-1]] += n
        own[frames[-1].rsplit(":", 1)[0]] += n
        for key in {f.rsplit(":", 1)[0] for f in frames}:
            incl[key] += n
    print(f"{total} samples inside {marker}")
    for title, counter in (("self, by function", own), ("inclusive", incl), ("self, by line", lines)):
        print(f"--- {title}")
        for key, n in counter.most_common(top):
            print(f"{100 * n / total:6.2f}% {key}")


if __name__ == "__main__":
    main()

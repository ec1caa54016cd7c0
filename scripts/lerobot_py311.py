"""Makes an installed lerobot (0.6.x, which declares Python >= 3.12) importable on Debian 12's Python 3.11.

lerobot is a test oracle only (tests/python/test_lerobot_*.py compare our robot-dataset readers with its
LeRobotDataset). Its code runs on 3.11 except a few PEP 695 constructs; this rewrites each into its 3.11 spelling,
in place, in the installed package:
  type Name = expr                      ->  Name = expr
  class Name[T, U](Bases):              ->  T = TypeVar("T") ... class Name(Bases, Generic[T, U]):
  def name[T: Bound](args) -> T:        ->  T = TypeVar("T", bound=Bound) ... def name(args) -> T:
Idempotent. Usage: python scripts/lerobot_py311.py SITE_PACKAGES_DIR
"""
import pathlib
import re
import sys

ALIAS = re.compile(r"^type (\w+) = (.*)$")
GENERIC = re.compile(r"^(class|def) (\w+)\[([^\]]*)\](.*)$")


def typevars(params):
    lines, names = [], []
    for p in params.split(","):
        p = p.strip()
        if not p:
            continue
        if ":" in p:
            name, bound = (s.strip() for s in p.split(":", 1))
            lines.append(f'{name} = TypeVar("{name}", bound={bound!r})')
        else:
            name = p
            lines.append(f'{name} = TypeVar("{name}")')
        names.append(name)
    return lines, names


def rewrite(text):
    out, changed = [], False
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        m = ALIAS.match(body)
        if m:
            out.append(f"{m.group(1)} = {m.group(2)}\n")
            changed = True
            continue
        m = GENERIC.match(body)
        if m:
            kind, name, params, rest = m.groups()
            tv, names = typevars(params)
            # the TypeVars go above the construct's decorators
            at = len(out)
            while at > 0 and out[at - 1].startswith("@"):
                at -= 1
            out[at:at] = ["from typing import Generic, TypeVar  # lerobot_py311\n"] + [t + "\n" for t in tv]
            if kind == "class":
                generic = f"Generic[{', '.join(names)}]"
                if rest.startswith("("):
                    rest = f"({rest[1:rest.index(')')]}, {generic}{rest[rest.index(')'):]}"
                else:
                    rest = f"({generic}){rest}"
            out.append(f"{kind} {name}{rest}\n")
            changed = True
            continue
        out.append(line)
    return "".join(out), changed


def main():
    root = pathlib.Path(sys.argv[1]) / "lerobot"
    if not root.is_dir():
        sys.exit(f"lerobot_py311: no lerobot package under {sys.argv[1]}")
    count = 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        new, changed = rewrite(text)
        if changed:
            path.write_text(new)
            count += 1
    print(f"lerobot_py311: rewrote {count} files")


if __name__ == "__main__":
    main()

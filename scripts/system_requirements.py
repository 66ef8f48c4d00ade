"""What `make ... TORCH=system` installs beside a GPU box's own torch: requirements.txt less
what that torch's environment must keep or cannot use. Prints the requirements to stdout
and what it left out, with why, to stderr.

  torch    the box's own (a CUDA build), never replaced
  numpy    the box's own where it has one: its torch was built against it, and a pinned
           numpy in the environment would shadow it
  torchao  only beside the torch it was built for (torchao 0.18: torch 2.13); its C++
           extensions fail against another torch with errors other than ImportError. Without
           it the precision lab's FP8 all-gather records "not run" and the rest runs.
  torchft  only beside torch >= 2.7 (torchft 0.2.0's own requirement): pip would otherwise
           install a second torch into the environment, over the box's CUDA build.

DeepSpeed 0.19.8 and Accelerate 1.15 ask for torch >= 2.0 and are installed as pinned.

    python scripts/system_requirements.py requirements.txt > .venv/requirements-system.txt
"""

import importlib.util
import re
import sys

# torchao's releases each pair with one torch release (torchao's README, "Installation")
TORCHAO_TORCH = {"0.18": "2.13"}
# torchft 0.2.0's metadata: Requires-Dist: torch>=2.7
TORCHFT_MIN_TORCH = (2, 7)


def pins(path):
    """[(name, line)] of the requirements file's pinned lines."""
    for line in open(path):
        match = re.match(r"([A-Za-z0-9_.-]+)==", line.strip())
        if match:
            yield match.group(1).lower(), line.strip()


def left_out(name, line, torch_version):
    """Why this pin is not installed beside the system torch, or None to install it."""
    if name == "torch":
        return "the box's own torch is kept"
    if name == "numpy" and importlib.util.find_spec("numpy") is not None:
        return "the box's own numpy is kept (its torch was built against it)"
    if name == "torchao":
        release = ".".join(line.split("==")[1].split(".")[:2])
        wanted = TORCHAO_TORCH.get(release)
        if wanted and not torch_version.startswith(wanted + "."):
            return (f"torchao {release} is built for torch {wanted}, this box has "
                    f"{torch_version}: the FP8 all-gather variant will say 'not run'")
    if name == "torchft":
        major_minor = tuple(int(part) for part in re.findall(r"\d+", torch_version)[:2])
        if major_minor < TORCHFT_MIN_TORCH:
            return (f"torchft needs torch >= {'.'.join(map(str, TORCHFT_MIN_TORCH))}, this box "
                    f"has {torch_version}: its variants will say 'not run'")
    return None


def main(path):
    import torch
    for name, line in pins(path):
        why = left_out(name, line, torch.__version__)
        if why:
            print(f"TORCH=system: not installing {line}: {why}", file=sys.stderr)
        else:
            print(line)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "requirements.txt")

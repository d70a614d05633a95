"""The shipped tiny drafters stored in bf16, as public drafter checkpoints are (z-lab's DFlash, SpecForge's EAGLE-3).

Every clone carries opd/assets/tiny, and float32 drafters would double it. A drafter loads into its target's dtype
whatever its file holds (`load_state_dict` copies, casting), so a float32 run reads each weight rounded to bf16 once,
and each card says what its τ reads so. `opd sft` saves a drafter in the dtype it trained in, so a rebuilt drafter is
stored so after its `opd sft ... --out opd/assets/tiny/NAME`:

    python -m opd.tiny.compact opd/assets/tiny/NAME
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from opd.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_weights, save_weights

STORED = torch.bfloat16
DTYPE_FIELDS = ("dtype", "torch_dtype")  # where config.json records the stored dtype: each family writes one


def store_compact(directory: Path) -> None:
    """Rewrite `directory`'s weights with every floating-point tensor in `STORED` (a draft vocabulary's integer and
    bool mappings as they are, names kept) and its config.json's dtype field to match: `opd export` loads the
    drafter in the recorded dtype, so an export writes the stored tensors back unchanged."""
    tensors = load_weights(directory / WEIGHTS_FILE)
    save_weights({name: t.to(STORED) if t.is_floating_point() else t for name, t in tensors.items()},
                 directory / WEIGHTS_FILE)
    path = directory / CONFIG_FILE
    config = json.loads(path.read_text(encoding="utf-8"))
    config |= {field: str(STORED).removeprefix("torch.") for field in DTYPE_FIELDS if field in config}
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opd.tiny.compact", description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", type=Path, metavar="DIR",
                        help="a drafter directory (config.json + model.safetensors), e.g. opd/assets/tiny/dflash2")
    for directory in parser.parse_args(argv).directories:
        store_compact(directory)
        print(f"{directory}: stored in {str(STORED).removeprefix('torch.')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

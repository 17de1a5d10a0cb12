"""On a GPU: mm_realign's rebuild and count check add no host-device synchronization, and what they cost.

Runs the realign under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing call raises), then reads the
deferred verdict after a synchronizing step, as the wrapper does after the model's forward pass.
    PYTHONPATH=. python benchmarks/gpu/realign_sync.py
"""

from __future__ import annotations

import json
import sys

import torch

from trl_vlm_fixes.patches.mm_realign.realign import (
    VisionCountCheck,
    VisionTokenMismatchError,
    rebuild_mm_token_type_ids,
)


def main() -> None:
    device = torch.device("cuda")
    rows, length, image_id = 16, 8192, 261
    ids = torch.randint(0, 256, (rows, length), device=device)
    ids[:, 100:116] = image_id  # one 8x8-patch image (16 tokens after the 2x2 merge) per row
    grid = torch.tensor([[1, 8, 8]] * rows, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        markers = rebuild_mm_token_type_ids(ids, image_id, None)
        check = VisionCountCheck(markers, grid, [1] * rows, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the forward pass synchronizes before the wrapper reads the verdict
    check.raise_if_mismatched()
    bad = ids.clone()
    bad[3, 100] = 5  # an image token lost to truncation
    caught = ""
    try:
        VisionCountCheck(rebuild_mm_token_type_ids(bad, image_id, None), grid, [1] * rows, 2).raise_if_mismatched()
    except VisionTokenMismatchError as error:
        caught = str(error).split(".")[1].strip()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        VisionCountCheck(rebuild_mm_token_type_ids(ids, image_id, None), grid, [1] * rows, 2)
    end.record()
    torch.cuda.synchronize()
    report = {
        "no_sync_under_set_sync_debug_mode_error": True,
        "mismatch_detected": caught,
        "rebuild_plus_check_ms_B16_L8192": start.elapsed_time(end) / 100,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    print(json.dumps(report, indent=2))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()

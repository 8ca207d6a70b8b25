"""``import cgx2`` (and its DDP and FSDP2 entry points) imports no training framework: the
recipes of examples/ bring Lightning and Accelerate, cgx2 does not depend on them."""

import subprocess
import sys


def test_cgx2_imports_no_framework():
    code = (
        "import sys, cgx2, cgx2.ddp, cgx2.fsdp; "
        "print(sorted({'lightning', 'pytorch_lightning', 'accelerate', 'transformers'} "
        "& {m.split('.')[0] for m in sys.modules}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout

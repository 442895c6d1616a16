"""The mHC package from the top-level namespace."""

import subprocess
import sys


def test_mhc_reachable_from_top_level():
    import flashsinkhorn as fs
    from flashsinkhorn import mhc

    assert "mhc" in fs.__all__
    assert fs.mhc is mhc
    for name in mhc.__all__:
        assert getattr(fs.mhc, name) is getattr(mhc, name)


def test_mhc_imported_on_first_access():
    # importing flashsinkhorn does not import Triton through mhc; fs.mhc does
    code = (
        "import sys, flashsinkhorn as fs; "
        "assert 'flashsinkhorn.mhc' not in sys.modules; "
        "fs.mhc.HyperConnection; "
        "assert 'flashsinkhorn.mhc' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

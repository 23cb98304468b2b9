"""``shardlang check FILE --costs HINTS.json``: the file's optimizer steps are planned under the
hints file's model (docs/calibration.md), which must fit the file's meshes."""

from __future__ import annotations

import json

from cli.main import main


def test_check_plans_under_a_hints_file(tmp_path, capsys):
    """``shardlang check --costs``: the file's steps are planned by the hints file's model, which
    must fit the file's meshes."""
    good, wide = tmp_path / "good.json", tmp_path / "wide.json"
    good.write_text(json.dumps({"alpha": 1e-4, "bandwidth": [1e9], "overhead": 1e-4, "copy_bandwidth": 2e9}))
    wide.write_text(json.dumps({"alpha": [1e-4, 1e-4]}))
    assert main(["check", "examples/tiny_gpt_dp4.shard", "--costs", str(good)]) == 0
    assert (
        capsys.readouterr().out == "examples/tiny_gpt_dp4.shard: ok: 2 tensors, 3 rules; meshes: world = mesh[dp=4]\n"
    )
    assert main(["check", "examples/tiny_gpt_dp4.shard", "--costs", str(wide)]) == 1
    err = capsys.readouterr().err
    assert "latency gives 2 values for the 1-axis mesh[dp=4]" in err and "Traceback" not in err

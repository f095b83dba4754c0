"""Issue 56, item 3 (check): a ``requires`` distribution that nothing here knows but whose
name is close to an installed one (``megatron-cor``) is reported as unknown, with the
nearest installed name, and ``check`` exits 3 (a requirement unmet): its patches would
never apply anywhere.  A real distribution that is simply absent (``vllm``, the other
side of a two-framework spec) stays "not installed", exit 0."""

from __future__ import annotations

import json

from source_patch.patcher.cli import main
from source_patch.patcher.requires import installed_version

PATCH = ("source_patch: 1.1\nname: r\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
         "    requires: {{{dist}: \">=0.1\"}}\n    edits:\n      - {{at: entry, code: pass}}\n"
         "  - id: q\n    module: spfix.basic\n    target: add\n    edits:\n      - {{at: return, code: pass}}\n")
SPEC = ("source_patch: 1.1\nname: r\nrequires: {{{dist}: \">=0.1\"}}\npatches:\n  - id: p\n    module: spfix.basic\n"
        "    target: add\n    edits:\n      - {{at: entry, code: pass}}\n")


def test_a_misspelled_distribution_in_a_patch_is_unknown_with_the_nearest_name(write_spec, capsys):
    assert installed_version("megatron-core") and installed_version("megatron-cor") is None
    path = write_spec(PATCH.format(dist="megatron-cor"))
    assert main(["check", str(path)]) == 3
    out = capsys.readouterr().out
    assert (f"unknown distribution 'megatron-cor' in the requires of patch 'p' ({path}:4): not installed here, and "
            f"no installed distribution has that name; nearest installed: megatron-core") in out, out


def test_json_names_the_distribution_and_the_nearest_installed_one(write_spec, capsys):
    path = write_spec(SPEC.format(dist="Megatron_Cor"))
    assert main(["check", "--json", str(path)]) == 3
    report = json.loads(capsys.readouterr().out)
    assert [(u["distribution"], u["nearest"], u["where"]) for u in report["unknown_distributions"]] == [
        ("Megatron_Cor", "megatron-core", f"spec 'r' ({path})")]
    assert report["exit"] == 3


def test_a_real_distribution_that_is_absent_is_not_installed_and_exits_0(write_spec, capsys):
    assert installed_version("vllm") is None
    path = write_spec(PATCH.format(dist="vllm"))
    assert main(["check", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unknown_distributions"] == []
    assert report["notes"] == ["gated p (spfix.basic): requires vllm>=0.1, which is not installed"]


def test_the_nearest_name_ignores_spelling_and_needs_a_close_name():
    from source_patch.patcher.requires import nearest_name

    names = {"megatron-core": "megatron-core", "torch": "torch", "sgl-kernel": "sgl-kernel"}
    assert nearest_name("megatron-cor", names) == "megatron-core"
    assert nearest_name("Megatron.Core", names) is None  # the installed one, spelled otherwise
    assert nearest_name("sglang", names) is None  # nothing close: absent, not misspelled
    assert nearest_name("torchvision", names) is None

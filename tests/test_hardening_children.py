"""Child processes import only our code (issue 57, item 4): the replay worker and the
trace forwarder start in whatever folder the job started in, and `python -c` / `-m`
put that folder first on sys.path.  Modules planted there must never run in them,
while PYTHONPATH (where a user may keep Megatron) still reaches them.  The entries
drop the folder themselves rather than pass -P (3.11+): these tests run that same
path on every supported version."""

import os

import pytest

from source_patch.runtime.verdict import replay
from source_patch.runtime.core.endpoint import free_port
from source_patch.runtime.trace import close, configure, reset, state, url

# Modules a child imports, planted in the job's folder: which ones a child imports
# after start-up varies (the start hook imports some first), so several.
PLANTS = ("json.py", "argparse.py", "shutil.py", "megatron/__init__.py", "source_patch/__init__.py",
          "numpy/__init__.py", "torch/__init__.py", "sitecustomize.py")
# What each does if a child imports it.
PLANTED = "open({marker!r}, 'a').write(__name__ + '\\n')\nraise ImportError('planted in the current folder')\n"
# On PYTHONPATH: proves the child started and still reads PYTHONPATH (`-I` would drop it).
STARTED = "import os\nopen({marker!r}, 'a').write(str(os.getpid()) + '\\n')\n"


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A job folder (the cwd) holding PLANTS, each writing to ``imported`` when imported;
    PYTHONPATH's sitecustomize writes to ``started``."""
    imported, started = tmp_path / "imported", tmp_path / "started"
    job, path = tmp_path / "job", tmp_path / "pythonpath"
    for module in PLANTS:
        (job / module).parent.mkdir(parents=True, exist_ok=True)
        (job / module).write_text(PLANTED.format(marker=str(imported)))
    path.mkdir()
    (path / "sitecustomize.py").write_text(STARTED.format(marker=str(started)))
    monkeypatch.chdir(job)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")])))
    return imported, started


def test_the_replay_worker_imports_nothing_from_the_folder_it_starts_in(planted, tmp_path, monkeypatch):
    imported, started = planted
    # the parent's own input checks would refuse these inputs before the worker starts
    monkeypatch.setattr(replay, "check_inputs", lambda *args, **kwargs: None, raising=False)
    checkpoint, rollout = tmp_path / "checkpoint", tmp_path / "rollout" / "rank0"
    checkpoint.mkdir(), rollout.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(replay.ReplayError):  # no dumps to replay: the worker says so and stops
        replay.replay(rollout, checkpoint, out=tmp_path / "out")
    assert started.exists(), "the worker did not start (or lost PYTHONPATH)"
    assert not imported.exists(), f"the worker imported {imported.read_text().split()} from its current folder"


def test_the_trace_forwarder_imports_nothing_from_the_folder_the_job_starts_in(planted, tmp_path):
    imported, started = planted
    configure(enable=True, port=free_port(), token="children", dir=str(tmp_path / "trace"), ranks=[0],
              hub="process", wait=0)
    try:
        reset()
        assert url() is not None, state().get("errors")
        pid = state()["hub"]["forwarder_pid"]
    finally:
        close()
        configure(enable=False, port=0, hub="process")
    assert started.read_text().split() == [str(pid)], "the forwarder did not start (or lost PYTHONPATH)"
    assert not imported.exists(), f"the forwarder imported {imported.read_text().split()} from the job's folder"


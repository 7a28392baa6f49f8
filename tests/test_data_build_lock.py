"""Under srun every task prepares the built-in data at once, before any process group exists:
one task builds it while the others wait on a file lock (hcp.data.digits.build_lock), then read
it. Three threads stand for three tasks (flock locks are per open file, so threads contend as
processes do); the scans are a slow stand-in for scikit-learn's, so today's unlocked build is
seen running in every task."""
import threading
import time
from types import SimpleNamespace

import numpy as np
import sklearn.datasets

from hcp.data.build import build_builtin


def test_one_task_builds_the_builtin_data_the_others_wait(tmp_path, monkeypatch):
    loads = []

    def load_digits():
        loads.append(threading.get_ident())
        time.sleep(0.5)  # every task has checked for the data set by now
        return SimpleNamespace(images=np.arange(20 * 64).reshape(20, 8, 8) % 17,
                               target=np.arange(20) % 10)

    monkeypatch.setattr(sklearn.datasets, "load_digits", load_digits)
    roots = []
    tasks = [threading.Thread(target=lambda: roots.append(build_builtin("digits_pair", str(tmp_path), 0.2)))
             for _ in range(3)]
    for t in tasks:
        t.start()
    for t in tasks:
        t.join()
    assert len(loads) == 1 and len(roots) == 3 and len(set(roots)) == 1
    assert (tmp_path / "digits_pair-v2-eval0.2" / "eval.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "digits_pair-v2-eval0.2", "digits_vqa-eval0.2"]   # no temporary folder left behind

"""pjinfer.measure.machine: the shares of CPU time that a benchmark's machine gave to others."""
import os
import subprocess
import sys
import time

from pjinfer.measure import machine


def test_shares_are_the_differences_of_the_samples():
    before, after = (100, 50, 10, 20), (300, 150, 40, 60)   # total, busy, steal, this process
    assert machine.shares(before, after) == {"steal": 30 / 200, "others": (100 - 40) / 200}
    assert machine.shares((0, 0, 0, 0), (100, 10, 0, 30)) == {"steal": 0.0, "others": 0.0}   # never negative
    assert machine.shares(None, after) is None and machine.shares(after, after) is None


def test_describe_warns_only_about_a_busy_machine():
    quiet = machine.describe({"steal": 0.01, "others": 0.05})
    busy = machine.describe({"steal": 0.31, "others": 0.02})
    assert quiet.startswith("machine during the runs: 1% ") and "busy" not in quiet
    assert "31% of CPU time stolen" in busy and "busy machine" in busy
    assert machine.describe(None) is None


def test_another_process_burning_a_core_counts_as_others_until_this_process_reaps_it():
    burn = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    before = machine.sample()
    burner = subprocess.Popen([sys.executable, "-c", burn])
    time.sleep(1.6)                            # this process sleeps while the child burns a core
    during = machine.sample()
    burner.wait()                              # now its time is this process's (cutime)
    after = machine.sample()
    cpus = os.cpu_count() or 1
    # A core of `cpus` for 1.5 s of the 1.6 s, less what the hypervisor stole from it.
    assert machine.shares(before, during)["others"] > 0.25 / cpus
    assert machine.shares(before, after)["others"] < machine.shares(before, during)["others"] - 0.2 / cpus


def test_the_last_level_cache_is_the_largest_cache_cpu0_reports():
    root = "/sys/devices/system/cpu/cpu0/cache"
    size = machine.last_level_cache_bytes()
    if not os.path.isdir(root):
        assert size is None
        return
    levels = {}
    for index in os.listdir(root):
        if index.startswith("index"):
            with open(f"{root}/{index}/level") as f:
                levels[index] = int(f.read())
    with open(f"{root}/{max(levels, key=levels.get)}/size") as f:
        assert size >= int(f.read().strip().rstrip("K")) << 10 >= 1 << 10

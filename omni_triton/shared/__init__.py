"""What the launcher and the stage stubs both use: the launch settings object (settings.py), the stage placement
(placement.py), the stub processes seen through /proc (procfs.py, stub_processes.py) and the workarounds for the
bundled Python backend (bundled_backend/)."""

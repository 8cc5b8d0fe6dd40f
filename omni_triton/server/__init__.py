"""Launching tritonserver on a rendered model repository (see tritonserver.py and repository.py)."""

"""How containers run here (README, Release): the local base image and podman's run flags."""

LOCAL_BASE_IMAGE = "localhost/optiserve-base:trixie"
RUN_FLAGS = [
    "--runtime",
    "runc",
    "--cgroup-manager=cgroupfs",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
    "--network",
    "host",
]

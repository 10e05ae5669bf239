"""Print the requirements setup.cfg declares, one per line: install_requires, then those of each
extra named on the command line. `.ci/run` installs them before the package itself, which it then
installs with `--no-deps`: the package's own (editable) install, which writes its metadata into the
checkout, is then a short step that two venvs' set-ups can take in turn.

    python .ci/requirements.py test docs
"""

import configparser
import pathlib
import sys


def requirements(extras):
    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parent.parent / "setup.cfg")
    found = config["options"]["install_requires"].splitlines()
    for extra in extras:
        found += config["options.extras_require"][extra].splitlines()
    return [line.strip() for line in found if line.strip() and not line.strip().startswith("#")]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))

"""Only here to ship the start hook: setuptools has no declarative way to put a
`.pth` file at the root of site-packages.  (Editable installs do not get it this
way; `source-patch hook install` puts it there.)"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = Path("patcher", "source_patch.pth")  # also package data, for `source-patch hook`


class BuildWithStartHook(build_py):
    def find_package_modules(self, package, package_dir):
        # The repository root is the package `source_patch` (its __init__.py: the public
        # names); this file sits there too and is no module of it.
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (m[0] == "source_patch" and m[1] == "setup")]

    def run(self):
        super().run()
        self.copy_file(str(Path(__file__).parent / HOOK), str(Path(self.build_lib) / HOOK.name))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / HOOK.name)]


setup(cmdclass={"build_py": BuildWithStartHook})

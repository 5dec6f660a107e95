"""Maps the source folders under the one namespace ``kv_preflight`` and builds the optional C block-key routine;
a failed compile leaves the pure-Python path in charge."""
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# The folders stay at the top of the source tree; in the wheel each is kv_preflight.<folder> (issue 14).
SOURCE_FOLDERS = ("cli", "shared", "ingester", "predictor", "simulator")
NAMESPACE = "kv_preflight"


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler: kv_preflight.shared.keys falls back to Python
            print(f"warning: C extension not built ({exc}); using the pure-Python block-key path")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: {ext.name} not built ({exc}); using the pure-Python block-key path")


setup(
    packages=[NAMESPACE] + [f"{NAMESPACE}.{p}" for folder in SOURCE_FOLDERS
                            for p in find_packages(include=[folder, f"{folder}.*"])],
    package_dir={NAMESPACE: NAMESPACE, **{f"{NAMESPACE}.{folder}": folder for folder in SOURCE_FOLDERS}},
    ext_modules=[Extension(f"{NAMESPACE}.shared._chain", ["shared/_chain.c"], extra_compile_args=["-O3"])],
    cmdclass={"build_ext": OptionalBuildExt},
)

"""Builds the optional C block-key routine; a failed compile leaves the pure-Python path in charge."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler: shared.keys falls back to Python
            print(f"warning: C extension not built ({exc}); using the pure-Python block-key path")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: {ext.name} not built ({exc}); using the pure-Python block-key path")


setup(
    ext_modules=[Extension("shared._chain", ["shared/_chain.c"], extra_compile_args=["-O3"])],
    cmdclass={"build_ext": OptionalBuildExt},
)

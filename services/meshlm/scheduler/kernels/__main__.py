"""`python -m meshlm.scheduler.kernels`: build meshlm's C kernels into the cache directory now
(an image's build stage, so that the image needs no compiler) and print where they are."""

from meshlm.scheduler.kernels.native import BuildError, load

built = load()
if isinstance(built, BuildError):
    raise SystemExit(f"meshlm kernels: {built}")
print(built.path)

"""``python -m countlens.cli …``: the command line as a module, as launchers run it
(``torchrun --nproc_per_node N -m countlens.cli discover …``)."""

from countlens.cli import main

if __name__ == "__main__":
    main()

"""``python -m analyzer``: the ``analyzer`` command, as torchrun launches it (``torchrun ... -m analyzer replay``)."""
from .cli import main

if __name__ == "__main__":
    main()

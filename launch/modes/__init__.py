"""The modes a pytest session runs in; ``launch.plugin`` picks one.

``lockstep`` (this process is a torchrun rank), ``server`` (a rank of a world
that a parent pytest launched), ``parent`` (plain pytest; launches worlds),
``simulated`` (``--dist-sim``: ranks as threads of this process). Each
implements ``launch.world.Mode``.
"""

"""dtensor's test service: a pytest plugin and a torchrun launcher.

Any ``torch.distributed`` code can be tested with it; it never imports
``dtensor``. See ``docs/test-service.md``.

- ``launch.plugin``: the pytest plugin (options, markers, the ``world`` fixture).
- ``python -m launch``: a thin CLI over ``torch.distributed.run``.
"""

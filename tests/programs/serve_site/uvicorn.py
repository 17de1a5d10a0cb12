"""Stands in for uvicorn, which the tests do not install: TRL's server ``main()`` has started its workers by then."""


def run(app, **kwargs):
    """Serve nothing: the workers end once their engine is built (``sitecustomize``), and then so does the server."""

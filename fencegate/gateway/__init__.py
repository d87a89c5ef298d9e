"""The receiver's half: the decision engine, the ASGI pipeline it runs in, and the two ways it
is deployed, a reverse proxy (`fencegate serve`) and `FencegateMiddleware`."""

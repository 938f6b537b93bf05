"""The HTTP routes of `tokenpipe serve`, one module per group; each exposes `routes(server)`."""

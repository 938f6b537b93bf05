"""tokenpipe supervisor: spawns workers, routes requests, the client API and the HTTP front end."""

"""tokenpipe worker: one process, one device, one model, many sessions."""

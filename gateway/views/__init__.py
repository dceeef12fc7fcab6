"""HTTP handlers: parse the request, call a service, render the result as JSON."""

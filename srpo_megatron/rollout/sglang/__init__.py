"""SGLang backend: ``protocol`` (wire contract, pure), ``transports`` (HTTP / offline child), ``engine``."""

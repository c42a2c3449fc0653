"""Transport adapters: broker deliveries in, settlements out. The core never imports these."""

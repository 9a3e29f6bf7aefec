"""What the device costs, as policies and the engine use it: the iteration cost model, the
device profile measured or fitted on it, the chats' first-token targets and the size of a
iteration that cannot be stopped, both derived from them."""

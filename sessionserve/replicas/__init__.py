"""One model replica: time (engine), admission (scheduler), tensors (model runner), sessions."""

module @m {ÿþý}

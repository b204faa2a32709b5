module {
  func.func @main() {
    foo.bar
    return
  }
}

fn main() {
    eprintln!("kinference-gateway: not built yet");
    std::process::exit(2);
}

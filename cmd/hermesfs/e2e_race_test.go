//go:build race

package main

// raceEnabled builds the daemon under test with the race detector too when
// the tests run with -race and no HERMESFS_BIN is given.
const raceEnabled = true

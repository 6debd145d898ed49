package memguard

import (
	"path/filepath"
	"testing"
)

// BenchmarkCheck is the policy's own share of a guarded update: the scan of a
// full MEMORY.md and the fsynced audit append (scan only, without the log, in
// the scan sub-benchmark).
func BenchmarkCheck(b *testing.B) {
	versions := [2][]byte{chars("Prefers tea. \n§\n", 2100), chars("Prefers coffee. \n§\n", 2100)}
	b.Run("scan", func(b *testing.B) {
		g, err := New(Options{AuditLog: filepath.Join(b.TempDir(), "audit.jsonl")})
		if err != nil {
			b.Fatal(err)
		}
		defer g.Close()
		b.SetBytes(int64(len(versions[0])))
		i := 0
		for b.Loop() {
			var ev Event
			if rej := g.decide(memFile, versions[i%2], versions[(i+1)%2], &ev); rej != nil {
				b.Fatal(rej)
			}
			i++
		}
	})
	b.Run("check", func(b *testing.B) {
		g, err := New(Options{AuditLog: filepath.Join(b.TempDir(), "audit.jsonl")})
		if err != nil {
			b.Fatal(err)
		}
		defer g.Close()
		i := 0
		for b.Loop() {
			if err := g.Check(b.Context(), memFile, versions[i%2], versions[(i+1)%2], 1); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
}
